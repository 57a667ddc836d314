"""Random-weight models of real shapes for benchmarks (built on the machine that runs them).

    python -m experiments.presets 1b OUT_DIR [--dtype bfloat16] [--bits 4]

`qwen3-moe` is a Qwen3-MoE-shaped model (Qwen3-30B-A3B layers, fewer of them; see below).
`1b` is the Llama 1.1B shape the device README's mlx-lm figures use (16 layers,
hidden 2048, MLP 8192, 32 heads / 8 KV heads, vocab 32000). The tokenizer files
are the llama fixture's (1024 pieces) padded up to the model's vocab with plain byte-level
pieces " w<id>" that no merge produces: a random model samples ids all over its vocab, and
an id the tokenizer cannot decode streams no text, which makes every server benchmark's TTFT
and per-request tok/s meaningless. `speed` is the 31.5M model of the CPU notes; `8b` the 8B
Llama shape; `e4b` the Gemma 4 e-variant shape (KV-sharing donors, per-layer inputs, sliding
and full layers) that experiments/peak_memory.py trains.
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
    # 8B Llama shape (the device README's decode figures).
    "8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
               tie_word_embeddings=False),
    # Gemma 4 e-variant shape (e4b): 42 layers, 7 full-attention (every 6th) + 35 sliding
    # (window 512), the last 18 layers share the K/V of the last earlier layer of their
    # type (double-wide MLP there), per-layer inputs of 256 per layer, vocab 262144.
    "e4b": dict(model_type="gemma4_text", hidden_size=2560, num_hidden_layers=42,
                intermediate_size=10240, num_attention_heads=8, num_key_value_heads=2,
                head_dim=256, global_head_dim=512, num_kv_shared_layers=18,
                hidden_size_per_layer_input=256, vocab_size=262144,
                vocab_size_per_layer_input=262144, sliding_window=512, sliding_window_pattern=6,
                rms_norm_eps=1e-6, max_position_embeddings=131072, final_logit_softcapping=30.0,
                use_double_wide_mlp=True, attention_k_eq_v=False, tie_word_embeddings=True,
                hidden_activation="gelu_pytorch_tanh"),
    # Qwen3-30B-A3B layer shapes (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of
    # MLP 768, top-8, renormalised; vocab 151936) with 8 of its 48 layers: 5.6B parameters,
    # 11 GB in bf16, so that building, saving and loading it twice fit one device run.
    "qwen3-moe": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=8,
                      intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True, vocab_size=151936, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, max_position_embeddings=40960,
                      tie_word_embeddings=False),
    # Qwen3-1.7B shape (dense, per-head q/k RMSNorm, tied embeddings): the one-kernel
    # step's q/k-norm phase
    "qwen3-2b": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28,
                     intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, tie_word_embeddings=True),
    "speed": dict(model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=4096, rms_norm_eps=1e-5,
                  rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=False),
}
# the same layout at CPU size (a smoke test of the device commands)
PRESETS["qwen3-moe-small"] = dict(
    PRESETS["qwen3-moe"], hidden_size=128, num_hidden_layers=2, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=64, vocab_size=4096)


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
    ap.add_argument("--layers", type=int, help="override num_hidden_layers (a shorter stack)")
    a = ap.parse_args(argv)
    if a.layers:
        PRESETS[a.preset] = dict(PRESETS[a.preset], num_hidden_layers=a.layers)
    print(build_preset(a.preset, Path(a.out), a.dtype, bits=a.bits))


if __name__ == "__main__":
    main()
