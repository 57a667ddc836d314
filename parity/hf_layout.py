"""A fixture model re-saved the way a Hugging Face `transformers` checkpoint is.

`write_hf_checkpoint(family, out, dtype)` takes the float32 `starter` fixture
of a family and writes, into `out`:

- `config.json` by transformers' own config class (`AutoConfig.for_model(...)
  .save_pretrained`): the keys, key names (`dtype`, `rope_parameters`,
  `transformers_version`, ...) and defaults transformers adds to a released
  checkpoint;
- the tokenizer by `PreTrainedTokenizerFast.save_pretrained`, and
  `generation_config.json` by `GenerationConfig.save_pretrained`;
- the weights (text-only families: the checkpoint's names are the MLX names), cast to `dtype`, in
  `model.safetensors` with `{"format": "pt"}` metadata.

The weights are written with MLX's safetensors writer, not by transformers:
transformers saves model weights only through a torch model (a ~200 MB+
download the test run does not otherwise need), and numpy cannot hold
bfloat16. The file format (safetensors), names and dtypes are what a torch
save produces; only the tensor order in the file may differ, which no
loader depends on.

This is the input `engine-convert` and `mlx_lm.convert` are compared on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

from starter.models import ensure_fixture

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# keys of our fixture configs that are not config attributes in transformers
_NOT_CONFIG = {"rope_traditional"}


def write_hf_checkpoint(family: str, out, dtype: str = "bfloat16",
                        classic_rope: bool = False) -> Path:
    """`classic_rope=True` also writes `rope_theta`/`rope_scaling` next to
    transformers-5's `rope_parameters`, as checkpoints saved by transformers 4.x
    carry them (mlx-lm's llama reads only the classic keys)."""
    from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

    if family not in ("llama", "qwen3", "gemma4_text"):
        raise ValueError(f"no transformers-layout writer for {family!r}")
    src = ensure_fixture(family, "float32")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=False)
    cfg = json.loads((src / "config.json").read_text())
    model_type = cfg.pop("model_type")
    for k in _NOT_CONFIG | {"torch_dtype"}:
        cfg.pop(k, None)
    AutoConfig.for_model(model_type, **cfg, dtype=dtype).save_pretrained(out)
    if classic_rope:
        saved = json.loads((out / "config.json").read_text())
        for k in ("rope_theta", "rope_scaling"):
            saved[k] = cfg.get(k)
        (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    PreTrainedTokenizerFast.from_pretrained(str(src)).save_pretrained(out)
    if (src / "generation_config.json").exists():
        GenerationConfig.from_pretrained(str(src)).save_pretrained(out)
    weights = mx.load(str(src / "model.safetensors"))
    weights = {k: v.astype(DTYPES[dtype]) for k, v in sorted(weights.items())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    return out


def write_hub_cache(cache, repo_id: str, src, rev: str = "0" * 40) -> Path:
    """Copy a model directory into `cache` the way huggingface_hub lays out a downloaded
    snapshot (`models--org--name/refs/main` -> `snapshots/<rev>/...`); returns the snapshot."""
    import shutil
    org, name = repo_id.split("/")
    repo = Path(cache) / f"models--{org}--{name}"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in Path(src).iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m parity.hf_layout",
        description="Write a built-in tiny model as a transformers-layout checkpoint "
                    "(needs `pip install transformers`; no torch).")
    p.add_argument("--family", default="llama", choices=["llama", "qwen3"])
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    args = p.parse_args(argv)
    try:
        out = write_hf_checkpoint(args.family, args.out, args.dtype,
                                  classic_rope=args.family == "llama")
    except FileExistsError:
        print(f"{args.out} already exists", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
