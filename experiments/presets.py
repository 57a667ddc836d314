"""Random-weight models of real shapes for benchmarks (built on the machine that runs them).

    python -m experiments.presets 1b OUT_DIR [--dtype bfloat16] [--bits 4]

`1b` is the Llama 1.1B shape the device README's mlx-lm figures use (16 layers,
hidden 2048, MLP 8192, 32 heads / 8 KV heads, vocab 32000). The tokenizer files
are the llama fixture's (1024 pieces) padded up to the model's vocab with plain byte-level
pieces " w<id>" that no merge produces: a random model samples ids all over its vocab, and
an id the tokenizer cannot decode streams no text, which makes every server benchmark's TTFT
and per-request tok/s meaningless. `speed` is the 31.5M model of the CPU notes.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

PRESETS = {
    "1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=32000,
               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
               tie_word_embeddings=False),
    # same size, head_dim 128 (8 query heads x 2 KV groups): MLX's CUDA quantized matmul
    # has no kernel for quantized-KV attention at head_dim 64, so KV-quant runs use this.
    "1b-hd128": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
                     rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                     tie_word_embeddings=False),
    # the 8B Llama 3 shape of the device README's figures (hidden 4096, 32 layers, MLP 14336)
    "8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
               tie_word_embeddings=False),
    "speed": dict(model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=4096, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=False),
}


def _pad_tokenizer(path: Path, vocab_size: int) -> None:
    """Give every id below vocab_size a decodable piece ("Ġ" is the byte-level space)."""
    tj = json.loads(path.read_text())
    vocab = tj["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tj.get("added_tokens", [])}
    for i in range(vocab_size):
        if i not in used:
            vocab[f"\u0120w{i}"] = i
    path.write_text(json.dumps(tj, ensure_ascii=False))


def build_preset(name: str, out: Path, dtype: str = "bfloat16", seed: int = 0,
                 bits: int | None = None, group_size: int = 64) -> Path:
    """Random weights of a preset shape; with `bits`, every Linear and the embedding are
    affine-quantized (mlx format: config "quantization", weight/scales/biases)."""
    from engine.models import build
    from parity.fixtures.models import ensure_fixture

    out = Path(out)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(PRESETS[name], bos_token_id=None, eos_token_id=None)
    tok_dir = ensure_fixture("llama", "float32")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json"):
        if (tok_dir / f).exists():
            shutil.copy(tok_dir / f, out / f)
    _pad_tokenizer(out / "tokenizer.json", cfg["vocab_size"])
    gc = json.loads((tok_dir / "generation_config.json").read_text())
    cfg.update(bos_token_id=gc.get("bos_token_id"), eos_token_id=gc.get("eos_token_id"))
    mx.random.seed(seed)
    model = build(cfg)
    model.set_dtype(getattr(mx, dtype))
    if bits:
        import mlx.nn as nn
        nn.quantize(model, group_size=group_size, bits=bits)
        cfg["quantization"] = {"group_size": group_size, "bits": bits}
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bits", type=int, default=None, help="quantize the weights (4 or 8)")
    a = ap.parse_args(argv)
    print(build_preset(a.preset, Path(a.out), a.dtype, bits=a.bits))


if __name__ == "__main__":
    main()
