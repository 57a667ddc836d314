"""A trained Llama's function in a larger Llama shape, zero-padded: the big target of the
speculation benchmarks.

What speculative decoding gains depends on what a step of the target costs against the
draft's: on an H100 the trained 1B's verify forward costs ~1.5 of its plain steps, both bound by
kernel launches (reports/spec_bench/0.5.9/). Training an 8B-shaped target on the synthetic
language does not fit a lend (AdamW in float32: ~130 GB of weights and moments), so `inflate`
writes a model of the larger shape (e.g. the 8b preset's: hidden 4096, 32 layers, head_dim 128,
MLP 14336) that computes the trained small model's function:

- every matrix holds the small one in a corner, zeros elsewhere (hidden, head and MLP dims);
  head dims map so that RoPE's rotation pairs stay pairs (dim j < D/2 -> j, D/2 + j -> D'/2 + j)
  and rope_theta' = rope_theta ** (D'/D) keeps each pair's frequency;
- the norms' weights are divided by sqrt(H'/H) and eps by H'/H (the zeros take H' - H of the
  mean square's H' terms);
- q's rows are multiplied by sqrt(D'/D) (attention scales by 1/sqrt(D'));
- layers past the small model's have zero projections: they add zeros to the residual.

Dense kernels read every byte whatever its value, so a step of the result costs what a step of
the larger shape costs, and its next-token distributions are the small model's up to rounding
(float32 on the CPU: tests/experiments/test_inflate.py). The vocabulary stays the small
model's (the draft's must match it). Llama only (no biases, rotate-half RoPE, no scaling other
than llama3's, which depends on a pair's frequency only).

    python experiments/inflate.py SMALL_DIR OUT_DIR --shape 8b
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.presets import PRESETS  # noqa: E402

KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim")


def _check(small: dict, big: dict) -> None:
    if small.get("model_type") != "llama" or big.get("model_type", "llama") != "llama":
        raise ValueError("inflate: llama models only")
    if small.get("rope_traditional") or small.get("attention_bias") or small.get("mlp_bias"):
        raise ValueError("inflate: rotate-half RoPE and no biases only")
    scaling = small.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"inflate: RoPE scaling {scaling!r} is not supported")
    for k in ("num_attention_heads", "num_key_value_heads"):
        if small[k] != big[k]:
            raise ValueError(f"inflate: {k} must match ({small[k]} vs {big[k]})")
    for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "head_dim"):
        if big[k] < small[k]:
            raise ValueError(f"inflate: {k} {big[k]} is smaller than the model's {small[k]}")
    if small["head_dim"] % 2 or big["head_dim"] % 2:
        raise ValueError("inflate: even head dims only")


def _head_rows(n_heads: int, d: int, d2: int) -> mx.array:
    """Where row (head h, dim j) of a [n_heads * d] projection goes in the [n_heads * d2] one."""
    h = mx.arange(n_heads)[:, None]
    j = mx.arange(d)[None, :]
    return (h * d2 + mx.where(j < d // 2, j, j - d // 2 + d2 // 2)).reshape(-1)


def _place(shape, src: mx.array, rows=None, cols=None) -> mx.array:
    """A zero matrix of `shape` with src at rows `rows` (default: the first) and cols `cols`."""
    out = mx.zeros(shape, dtype=mx.float32)
    r = rows if rows is not None else mx.arange(src.shape[0])
    c = cols if cols is not None else mx.arange(src.shape[1])
    return out.at[r[:, None], c[None, :]].add(src.astype(mx.float32))


def inflate_weights(w: dict, small: dict, big: dict):
    """The larger shape's weights from the small model's `w` (see the module doc): (name,
    float32 array) pairs, one matrix at a time (an 8B's would be 32 GB in float32 at once)."""
    H, H2 = small["hidden_size"], big["hidden_size"]
    D, D2 = small["head_dim"], big["head_dim"]
    I2 = big["intermediate_size"]
    NQ, NKV = small["num_attention_heads"], small["num_key_value_heads"]
    L, L2 = small["num_hidden_layers"], big["num_hidden_layers"]
    norm = 1.0 / math.sqrt(H2 / H)
    qrows, kvrows = _head_rows(NQ, D, D2), _head_rows(NKV, D, D2)

    def vec(x):
        return mx.concatenate([x.astype(mx.float32) * norm, mx.ones((H2 - H,), mx.float32) * norm])

    yield "model.embed_tokens.weight", _place((w["model.embed_tokens.weight"].shape[0], H2),
                                              w["model.embed_tokens.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    yield "lm_head.weight", _place((head.shape[0], H2), head)
    yield "model.norm.weight", vec(w["model.norm.weight"])
    for i in range(L2):
        p, q = f"model.layers.{i}.", f"model.layers.{min(i, L - 1)}."
        keep = i < L
        g = (lambda name: w[q + name]) if keep else (lambda name: mx.zeros_like(w[q + name]))
        yield p + "input_layernorm.weight", vec(w[q + "input_layernorm.weight"])
        yield p + "post_attention_layernorm.weight", vec(w[q + "post_attention_layernorm.weight"])
        a = p + "self_attn."
        yield a + "q_proj.weight", _place((NQ * D2, H2), g("self_attn.q_proj.weight").astype(mx.float32)
                                          * math.sqrt(D2 / D), rows=qrows)
        yield a + "k_proj.weight", _place((NKV * D2, H2), g("self_attn.k_proj.weight"), rows=kvrows)
        yield a + "v_proj.weight", _place((NKV * D2, H2), g("self_attn.v_proj.weight"), rows=kvrows)
        yield a + "o_proj.weight", _place((H2, NQ * D2), g("self_attn.o_proj.weight"), cols=qrows)
        m = p + "mlp."
        yield m + "gate_proj.weight", _place((I2, H2), g("mlp.gate_proj.weight"))
        yield m + "up_proj.weight", _place((I2, H2), g("mlp.up_proj.weight"))
        yield m + "down_proj.weight", _place((H2, I2), g("mlp.down_proj.weight"))


def inflate(src: Path, dst: Path, shape: str = "8b", dtype: str = "bfloat16") -> Path:
    """The model of `src` in preset `shape`'s dimensions (its vocabulary kept), saved in `dst`."""
    src, dst = Path(src), Path(dst)
    small = json.loads((src / "config.json").read_text())
    big = {k: PRESETS[shape][k] for k in KEYS}
    _check(small, {**big, "model_type": PRESETS[shape]["model_type"]})
    w = mx.load(str(src / "model.safetensors"))
    weights = {}
    for k, v in inflate_weights(w, small, big):
        weights[k] = v.astype(getattr(mx, dtype))
        mx.eval(weights[k])
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = dict(small, **big, tie_word_embeddings=False,
               rms_norm_eps=small["rms_norm_eps"] * small["hidden_size"] / big["hidden_size"],
               rope_theta=small.get("rope_theta", 10000.0) ** (big["head_dim"] / small["head_dim"]),
               inflated_from={k: small[k] for k in KEYS})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    print(inflate(Path(a.src), Path(a.out), a.shape, a.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
