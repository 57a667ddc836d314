"""`engine-convert`: a Hugging Face checkpoint -> an MLX model directory.

    engine-convert --hf-path SRC --mlx-path DST [-q | -d] [--q-bits 4|8] [--q-group-size N]
                   [--q-mode affine|mxfp4|nvfp4|mxfp8] [--quant-predicate mixed_3_6]
                   [--dtype float16|bfloat16|float32] [--max-shard-gb GB]

SRC is a directory or a Hugging Face repo id. The output is what mlx-lm's
converter writes for the same input (the tests compare the files byte for
byte): weights in the model's parameter order in `model.safetensors` (or
`model-0000i-of-0000n.safetensors` shards past the shard size) with
`model.safetensors.index.json`, a sorted `config.json` (with the
`quantization` block the loader reads back), the tokenizer files,
`generation_config.json` and a model card.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from .argparsing import CliParser
from .loader import load_model, read_config, resolve_model_path

DTYPES = ("float16", "bfloat16", "float32")
RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
DEFAULT_SHARD_GB = 5


class ConvertError(ValueError):
    """Bad conversion options or an unusable source."""


@dataclass
class ConvertOptions:
    quantize: bool = False
    q_bits: Optional[int] = None
    q_group_size: Optional[int] = None
    q_mode: str = "affine"
    quant_predicate: Optional[str] = None     # a mixed recipe name, e.g. "mixed_3_6"
    dtype: Optional[str] = None               # None: the config's torch_dtype, if any
    max_shard_bytes: int = DEFAULT_SHARD_GB << 30
    dequantize: bool = False


Predicate = Callable[[str, nn.Module], Union[bool, dict]]
VISION_MODULES = ("vision_tower.", "multi_modal_projector.")
VISION_FILES = ("preprocessor_config.json", "processor_config.json")


def mixed_recipe(name: str, model: nn.Module, group_size: int) -> Predicate:
    """Per-layer bits in the spirit of llama.cpp's Q4_K_M: more bits for v_proj and
    down_proj in the first and last eighth of the layers and every third layer
    between, and for lm_head; fewer bits everywhere else."""
    if name not in RECIPES:
        raise ConvertError(f"unknown quant recipe {name!r} (one of {', '.join(RECIPES)})")
    low, high = RECIPES[name]
    down = [k for k, _ in model.named_modules() if "down_proj" in k]
    if not down:
        raise ConvertError("the model has no down_proj layers for a mixed recipe")
    where = next((i for i, part in enumerate(down[0].split(".")) if part.isdigit()), None)
    n = len(model.layers)

    def predicate(path: str, module: nn.Module):
        parts = path.split(".")
        idx = int(parts[where]) if where is not None and len(parts) > where else 0
        more = idx < n // 8 or idx >= 7 * n // 8 or (idx - n // 8) % 3 == 2
        high_here = ("lm_head" in path
                     or (more and ("down_proj" in path
                                   or any(v in path for v in ("v_proj", "v_a_proj", "v_b_proj")))))
        return {"group_size": group_size, "bits": high if high_here else low, "mode": "affine"}

    return predicate


def source_config(src: Path) -> dict:
    """config.json as the converter sees it: generation_config's eos ids win, and
    a quantization_config nested in text_config is lifted to the top."""
    config = read_config(src)
    gen = src / "generation_config.json"
    if gen.exists():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id", False)
        except json.JSONDecodeError:
            eos = False
        if eos:
            config["eos_token_id"] = eos
    tc = config.get("text_config", {})
    if "quantization_config" not in config and "quantization_config" in tc:
        config["quantization_config"] = tc["quantization_config"]
    return config


def cast(model: nn.Module, config: dict, dtype: Optional[str]) -> None:
    if dtype is None:
        dtype = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if dtype not in DTYPES:
        return
    target = getattr(mx, dtype)
    keep = getattr(model, "cast_predicate", lambda _: True)

    def to(k, v):
        return v.astype(target) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v
    model.update(tree_map_with_path(to, model.parameters()))


def quantize(model: nn.Module, config: dict, opts: ConvertOptions) -> dict:
    """Quantize in place; returns the config with its `quantization` block."""
    if opts.q_mode not in MODE_DEFAULTS:
        raise ConvertError(f"unknown --q-mode {opts.q_mode!r}")
    group, bits = MODE_DEFAULTS[opts.q_mode]
    group, bits = opts.q_group_size or group, opts.q_bits or bits
    chosen = getattr(model, "quant_predicate", None)
    if opts.quant_predicate:
        if opts.q_mode != "affine":
            raise ConvertError("mixed recipes are affine only (--q-mode affine)")
        chosen = mixed_recipe(opts.quant_predicate, model, group)
    params = {"group_size": group, "bits": bits, "mode": opts.q_mode}
    config = json.loads(json.dumps(config))
    per_layer = "quantization" in config      # already partly quantized: record each layer
    if not per_layer:
        config["quantization"] = dict(params)

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group:
            return False
        if path.startswith(VISION_MODULES):    # the vision tower stays float (as mlx-vlm's)
            return False
        choice = chosen(path, module) if chosen is not None else True
        if isinstance(choice, dict):
            config["quantization"][path] = choice
        elif per_layer and choice:
            config["quantization"][path] = params
        return choice

    nn.quantize(model, group, bits, mode=opts.q_mode, class_predicate=predicate)
    config["quantization_config"] = config["quantization"]
    return config


def bits_per_weight(model: nn.Module) -> float:
    """mlx-lm's figure: the bytes of every array the model holds (rope tables too) over
    the parameter count of the unquantized model."""
    from mlx.utils import tree_reduce

    nbytes = tree_reduce(lambda n, x: n + x.nbytes if isinstance(x, mx.array) else n, model, 0)
    return nbytes * 8 / parameter_count(model)


def dequantize(model: nn.Module, config: dict) -> dict:
    """Replace every quantized layer by its float form, in place; returns the config
    without its quantization blocks."""
    from mlx.utils import tree_unflatten

    from .models.switch import QuantizedSwitchLinear, SwitchLinear

    plain = []
    for name, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            make = lambda shape, bias: nn.Linear(*shape, bias=bias)
        elif isinstance(m, nn.QuantizedEmbedding):
            make = lambda shape, bias: nn.Embedding(*shape)
        elif isinstance(m, QuantizedSwitchLinear):
            make = lambda shape, bias: SwitchLinear(*shape)
        else:
            continue
        w = mx.dequantize(m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits,
                          getattr(m, "mode", "affine"))
        layer = make(w.shape[::-1], "bias" in m)
        layer.weight = w
        if "bias" in m:
            layer.bias = m["bias"]
        plain.append((name, layer))
    if plain:
        model.update_modules(tree_unflatten(plain))
    config = dict(config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return config


def parameter_count(model: nn.Module) -> int:
    """Parameters as the unquantized model has them (a packed weight counts its values)."""
    total = 0
    for _, m in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        if hasattr(m, "bits"):
            total += m.weight.size * 32 // m.bits + (m.bias.size if "bias" in m else 0)
        else:
            total += sum(v.size for _, v in tree_flatten(m.parameters()))
    return total


def shards(weights: dict, max_bytes: int) -> list[dict]:
    """Consecutive groups of at most max_bytes (a bigger tensor gets its own shard)."""
    out: list[dict] = []
    size = 0
    for k, v in weights.items():
        if not out or size + v.nbytes > max_bytes:
            out.append({})
            size = 0
        out[-1][k] = v
        size += v.nbytes
    return out


def save_weights(dst: Path, model: nn.Module, max_bytes: int) -> None:
    weights = dict(tree_flatten(model.parameters()))
    groups = shards(weights, max_bytes)
    n = len(groups)
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values()),
                          "total_parameters": parameter_count(model)}, "weight_map": {}}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        mx.save_safetensors(str(dst / name), group, metadata={"format": "mlx"})
        index["weight_map"].update({k: name for k in group})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def _tag_non_finite(obj):
    """inf/nan as transformers tags them ({"__float__": "Infinity"}), so the JSON stays valid."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: _tag_non_finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tag_non_finite(v) for v in obj]
    return obj


def save_config(dst: Path, config: dict, keep_vision: bool = False) -> None:
    """config.json; `vision_config` only where the model kept its vision tower (Gemma 3
    with a whole tower: `engine.models.gemma3`)."""
    config = dict(config)
    config.pop("_name_or_path", None)
    if not keep_vision:
        config.pop("vision_config", None)
    if "quantization" in config:
        config["quantization_config"] = config["quantization"]
    with open(dst / "config.json", "w") as f:
        json.dump(_tag_non_finite(dict(sorted(config.items()))), f, indent=4)


def write_model_card(dst: Path, src: Path, repo_id: Optional[str]) -> None:
    """README.md with the hub metadata MLX models carry (library mlx, base model)."""
    from huggingface_hub import ModelCard, ModelCardData

    if repo_id is not None and (src / "README.md").is_file():
        card = ModelCard.load(src / "README.md")
    else:
        card = ModelCard.from_template(ModelCardData(language="en"))
    card.data.library_name = "mlx"
    card.data.pipeline_tag = "text-generation"
    card.data.tags = (card.data.tags or []) + (["mlx"] if "mlx" not in (card.data.tags or []) else [])
    if repo_id is not None:
        card.data.base_model = repo_id
    card.text = ""
    card.save(str(dst / "README.md"))


# mlx-lm records the tool-call format it reads from the chat template in
# tokenizer_config.json as `tool_parser_type`; the formats this engine parses, in
# the order mlx-lm tests the template for them
_TOOL_MARKERS = (
    ("gemma4", lambda t: "<|tool_call>" in t and "<tool_call|>" in t),
    ("qwen3_coder", lambda t: "<tool_call>\\n<function=" in t or "<tool_call>\n<function=" in t),
    ("minicpm5", lambda t: '<function name="' in t and '<param name="' in t),
    ("json_tools", lambda t: "<tool_call>" in t and "tool_call.name" in t),
)


def tool_parser_type(template) -> Optional[str]:
    if not isinstance(template, str):
        return None
    return next((name for name, seen in _TOOL_MARKERS if seen(template)), None)


def save_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files as they are, plus `tool_parser_type` when the template shows one."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    cfg_file = dst / "tokenizer_config.json"
    if not cfg_file.is_file():
        return
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    jinja = src / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else cfg.get("chat_template")
    parser = tool_parser_type(template)
    if parser is not None and "tool_parser_type" not in cfg:
        cfg["tool_parser_type"] = parser
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                            encoding="utf-8")


def convert(hf_path, mlx_path, opts: Optional[ConvertOptions] = None,
            revision: Optional[str] = None, log=print) -> Path:
    opts = opts or ConvertOptions()
    dst = Path(mlx_path)
    if dst.exists():
        raise ConvertError(f"{dst} already exists; remove it or pick another --mlx-path")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}")
    src = resolve_model_path(hf_path, revision=revision)
    repo_id = None if Path(hf_path).expanduser().exists() else str(hf_path)
    log(f"loading {src}")
    model, _ = load_model(src, lazy=True)
    config = source_config(src)
    cast(model, config, opts.dtype)
    if opts.quantize and opts.dequantize:
        raise ConvertError("choose -q (quantize) or -d (dequantize), not both")
    if opts.quantize:
        log("quantizing")
        config = quantize(model, config, opts)
        log(f"Quantized model with {bits_per_weight(model):.3f} bits per weight.")
    elif opts.quant_predicate:
        raise ConvertError("--quant-predicate needs -q")
    if opts.dequantize:
        if "quantization" not in config:
            raise ConvertError(f"{hf_path} is not quantized: nothing to dequantize")
        log("dequantizing")
        config = dequantize(model, config)
    dst.mkdir(parents=True)
    save_weights(dst, model, opts.max_shard_bytes)
    vision = getattr(model, "vision", None) is not None
    save_config(dst, config, keep_vision=vision)
    save_tokenizer(src, dst)
    for name in VISION_FILES if vision else ():
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    for py in src.glob("*.py"):
        shutil.copy(py, dst / py.name)
    write_model_card(dst, src, repo_id)
    log(f"wrote {dst}")
    return dst


def parser() -> argparse.ArgumentParser:
    p = CliParser(prog="engine-convert", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--hf-path", "--model", dest="hf_path", required=True,
      help="source model: a directory or a Hugging Face repo id")
    a("--mlx-path", default="mlx_model", help="output directory (must not exist; mlx_model)")
    a("-q", "--quantize", action="store_true", help="quantize the weights (prints the bits "
      "per weight)")
    a("-d", "--dequantize", action="store_true", help="dequantize a quantized model to its "
      "float weights")
    a("--q-bits", type=int, help="bits per weight (default 4; mxfp8: 8)")
    a("--q-group-size", type=int, help="quantization group size (default 64 for affine)")
    a("--q-mode", default="affine", choices=list(MODE_DEFAULTS), help="quantization mode")
    a("--quant-predicate", choices=list(RECIPES), help="mixed-bit recipe (with -q)")
    a("--dtype", choices=list(DTYPES),
      help="dtype of the float parameters (default: config.json's torch_dtype, else kept)")
    a("--revision", help="hub revision (branch, tag or commit) for a repo id")
    a("--max-shard-gb", type=float, default=DEFAULT_SHARD_GB,
      help=f"largest weight file in GiB (default {DEFAULT_SHARD_GB})")
    a("--trust-remote-code", action="store_true",
      help="accepted for mlx-lm compatibility (no model code is downloaded)")
    p.unsupported({"--upload-repo": "uploading to the Hugging Face Hub is not implemented; "
                                    "upload DST with `hf upload`"})
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.max_shard_gb <= 0:
        print("engine-convert: --max-shard-gb must be > 0", file=sys.stderr)
        return 2
    opts = ConvertOptions(quantize=args.quantize, q_bits=args.q_bits,
                          q_group_size=args.q_group_size, q_mode=args.q_mode,
                          quant_predicate=args.quant_predicate, dtype=args.dtype,
                          max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
                          dequantize=args.dequantize)
    try:
        convert(args.hf_path, args.mlx_path, opts, revision=args.revision,
                log=lambda m: print(f"engine-convert: {m}", file=sys.stderr))
    except (ValueError, OSError) as e:   # ConvertError, ModelLoadError, unsupported model_type
        print(f"engine-convert: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
