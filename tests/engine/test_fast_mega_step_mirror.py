"""The one-kernel step (engine/fast/cuda/mega_step.cu), phase by phase in numpy, against L1.

The kernel runs on NVIDIA GPUs only; this mirror follows its computation on the llama
bf16 fixture with the kernel's rounding points: the RMSNorm applied as a scale after the
dot product (the normalised input never rounded), each projection's output rounded to the
model's dtype, RoPE on the rotation pairs (i, i + D/2) at the position, keys and values
rounded into the cache, attention through the chunked mirror of test_fast_mega_mirror,
residual adds and SiLU·up rounded as the model's own operations. Teacher-forced over a
few decode steps, its logits must agree with L1's to within bf16 rounding, and each
deliberately broken variant (RoPE one position off, the newest key dropped, gate and up
rows swapped) must move them further than that. The same for qwen3 with its per-head q/k
norms (phase A2 of the kernel), where leaving the norms out must move them further.
"""

import mlx.core as mx
import numpy as np
import pytest
from gemv_mirror import round_to, to_np
from test_fast_mega_mirror import mirror as attention_mirror

from engine.fast import kernels as K
from engine.fast.merge import merge_projections, merged_of
from engine.loader import load_model
from parity.fixtures.models import ensure_fixture


class Mirror:
    def __init__(self, model):
        merge_projections(model)
        self.dt = model.layers[0].input_layernorm.weight.dtype
        a0 = model.layers[0].self_attn
        self.NQ, self.NKV, self.D = a0.n_heads, a0.n_kv_heads, a0.head_dim
        self.scale = a0.scale
        self.inv_freq = to_np(K.rope_inv_freq(a0.rope, self.D))
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(dict(
                ln1=to_np(layer.input_layernorm.weight), eps=layer.input_layernorm.eps,
                wqkv=to_np(merged_of(attn, ("q_proj", "k_proj", "v_proj")).linear.weight),
                wo=to_np(attn.o_proj.weight), ln2=to_np(layer.post_attention_layernorm.weight),
                wgu=to_np(merged_of(mlp, ("gate_proj", "up_proj")).linear.weight),
                wd=to_np(mlp.down_proj.weight)))
            if hasattr(attn, "q_norm"):             # qwen3: per-head q/k RMSNorm (phase A2)
                self.layers[-1].update(qn=to_np(attn.q_norm.weight), kn=to_np(attn.k_norm.weight),
                                       qk_eps=attn.q_norm.eps)
        norm, head = model.head_parts()
        self.fnorm, self.headw = to_np(norm.weight), to_np(head.weight)
        self.emb = to_np(model.model.embed_tokens.weight)

    def r(self, a):
        return round_to(a, self.dt)

    def normed_dot(self, W, h, nw, eps):
        """Σ W·(nw ⊙ h), then × rsqrt(mean(h²) + eps), rounded (the kernel's norm as a scale)."""
        inv = 1.0 / np.sqrt(np.float32(h @ h) / h.size + np.float32(eps))
        return self.r((W @ (h * nw)) * inv)

    def head_norm(self, x, w, eps):
        """Phase A2: a head's values (rounded projections) RMS-normalised in float32,
        rounded, times the weight, rounded (as the model's RMSNorm rounds)."""
        inv = 1.0 / np.sqrt(np.float32(x @ x) / x.size + np.float32(eps))
        return self.r(self.r(x * inv) * w)

    def step(self, tok, pos, kc, vc, shift=0, drop=0, swap_gate_up=False, skip_qk_norm=False):
        NQ, NKV, D, half = self.NQ, self.NKV, self.D, self.D // 2
        h = self.emb[tok].copy()
        for i, w in enumerate(self.layers):
            qkv = self.normed_dot(w["wqkv"], h, w["ln1"], w["eps"])
            th = np.float32(pos + shift) * self.inv_freq
            c, s = np.cos(th), np.sin(th)
            heads = qkv.reshape(NQ + 2 * NKV, D)
            if "qn" in w and not skip_qk_norm:
                heads = np.concatenate([
                    [self.head_norm(x, w["qn"], w["qk_eps"]) for x in heads[:NQ]],
                    [self.head_norm(x, w["kn"], w["qk_eps"]) for x in heads[NQ:NQ + NKV]],
                    heads[NQ + NKV:]])
            x1, x2 = heads[:NQ + NKV, :half], heads[:NQ + NKV, half:]
            rot = self.r(np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=1))
            q, k, v = rot[:NQ], rot[NQ:], heads[NQ + NKV:]
            kc[i][:, pos], vc[i][:, pos] = k, v
            o = np.concatenate([self.r(attention_mirror(q[hq], kc[i][hq // (NQ // NKV), :pos + 1],
                                                        vc[i][hq // (NQ // NKV), :pos + 1],
                                                        self.scale, 0, pos, drop))
                                for hq in range(NQ)])
            h = self.r(h + self.r(w["wo"] @ o))
            gu = self.normed_dot(w["wgu"], h, w["ln2"], w["eps"])
            g, u = np.split(gu, 2)
            if swap_gate_up:
                g, u = u, g
            act = self.r(self.r(g / (1 + np.exp(-g))) * u)
            h = self.r(h + self.r(w["wd"] @ act))
        return self.normed_dot(self.headw, h, self.fnorm, self.layers[0]["eps"])


def run(model, mir, prompt, seq, **fault):
    """Per step: (L1 logits, mirror logits), both fed the same tokens."""
    caches = model.make_cache()
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    n = len(prompt)
    cap = n + len(seq) + 1
    kc = [np.zeros((mir.NKV, cap, mir.D), np.float32) for _ in mir.layers]
    vc = [np.zeros((mir.NKV, cap, mir.D), np.float32) for _ in mir.layers]
    for i, c in enumerate(caches):
        kc[i][:, :n] = to_np(c.keys[0, :, :n])
        vc[i][:, :n] = to_np(c.values[0, :, :n])
    out, y = [], prompt[-1]
    for t, pos in zip(seq, range(n, n + len(seq))):
        ref = to_np(model(mx.array([[y]]), cache=caches)[0, -1])
        out.append((ref, mir.step(y, pos, kc, vc, **fault)))
        y = t
    return out


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def case(family: str, seed: int):
    """(model, its mirror, a 40-token prompt, 6 tokens to feed) for a bf16 fixture."""
    model = load_model(str(ensure_fixture(family, "bfloat16")))[0]
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(1, 1000, 40)]
    seq = [int(t) for t in rng.integers(1, 1000, 6)]
    return model, Mirror(model), prompt, seq


@pytest.fixture(scope="module")
def setup():
    return case("llama", 7)


def test_mirror_agrees_with_l1(setup):
    model, mir, prompt, seq = setup
    for ref, got in run(model, mir, prompt, seq):
        assert rel(got, ref) < 2e-2
        assert np.argmax(got) == np.argmax(ref)


@pytest.mark.parametrize("fault", [dict(shift=1), dict(drop=1), dict(swap_gate_up=True)])
def test_broken_mirrors_move_further(setup, fault):
    model, mir, prompt, seq = setup
    good = max(rel(g, r) for r, g in run(model, mir, prompt, seq))
    bad = max(rel(g, r) for r, g in run(model, mir, prompt, seq, **fault))
    assert bad > 2 * good, (good, bad)


@pytest.fixture(scope="module")
def setup_qwen3():
    return case("qwen3", 11)


def test_mirror_with_q_k_norms_agrees_with_l1(setup_qwen3):
    """qwen3 (phase A2: each q and k head RMS-normalised before RoPE): same bound as llama,
    and leaving the norms out must move the logits further."""
    model, mir, prompt, seq = setup_qwen3
    good = run(model, mir, prompt, seq)
    for ref, got in good:
        assert rel(got, ref) < 2e-2
        assert np.argmax(got) == np.argmax(ref)
    bad = max(rel(g, r) for r, g in run(model, mir, prompt, seq, skip_qk_norm=True))
    assert bad > 2 * max(rel(g, r) for r, g in good), bad
