"""The fused GEMV kernel (engine/fast/gemv.py), checked on the CPU.

The CUDA kernel runs only on an NVIDIA GPU (experiments/l3_kernel_check.py runs it
there against the stock-MLX path). Here its decomposition is mirrored in numpy, loop
for loop: KSPLIT warps per output row (a gate row paired with its up row for the SiLU
epilogue), warp slice w's 32 lanes reading 16-byte vectors at k = (it*32 + lane) * VEC for
it = w, w + KSPLIT, ..., the sum of squares
of the input accumulated in the same pass (the norm applied as a scale at the end),
the lanes' partial sums reduced, and the epilogue with the kernel's roundings. The mirror
is compared with the stock-MLX path the CPU runs (`gemv.linear(..., use_kernel=False)`,
the model's own operations): a wrong row pairing, k mapping, or epilogue shows up as a
large error; bf16 rounding stays under the bound (relative error < 1e-2).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.fast import gemv as G
from gemv_mirror import epilogue_mirror, round_to, to_np


def gemv_mirror(W, x, dt, norm=None, residual=None, silu_split=None, ksplit=1):
    """engine/fast/cuda/gemv_main.cu + gemv_epilogue.cu in numpy: returns [B, NOUT] float32
    (values representable in dt).
    `ksplit` warps per row, warp slice s taking iterations s, s + ksplit, ... (lane l of
    iteration it: the vector at k = (it * 32 + l) * VEC)."""
    N, K = W.shape
    B = x.shape[0]
    vec = 16 // mx.array(0, dt).itemsize
    nout = silu_split or N
    warps = ksplit
    its = -(-K // (32 * vec))
    nw = norm[0] if norm is not None else np.ones(K, np.float32)
    out = np.zeros((B, nout), np.float32)
    for n in range(nout):                              # one row's warps
        for b in range(B):
            def lanes(row):
                acc, ss = np.zeros((warps, 32), np.float32), np.zeros((warps, 32), np.float32)
                for warp in range(warps):
                    for lane in range(32):
                        for it in range(warp, its, warps):
                            k = (it * 32 + lane) * vec
                            if k < K:
                                xs = x[b, k:k + vec]
                                ss[warp, lane] += np.float32(xs @ xs)
                                acc[warp, lane] += np.float32(W[row, k:k + vec] @ (xs * nw[k:k + vec]))
                return np.float32(acc.sum()), np.float32(ss.sum())
            out[b, n] = epilogue_mirror(lanes, n, b, K, dt, norm, residual, silu_split)
    return out


CASES = [  # (K, N, B, epilogue)
    (512, 24, 1, "norm"),
    (1024, 16, 2, "residual"),
    (384, 40, 1, "silu"),        # K not a multiple of 256*VEC: the tail vectors
    (256, 12, 3, "plain"),
]


@pytest.mark.parametrize("K,N,B,epi", CASES)
@pytest.mark.parametrize("dt", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("ksplit", [1, 2, 4])
def test_gemv_mirror_matches_standin(K, N, B, epi, dt, ksplit):
    mx.random.seed(K + N + B)
    lin = nn.Linear(K, N, bias=False)
    lin.weight = (mx.random.normal((N, K)) * 0.05).astype(dt)
    x = mx.random.normal((B, 1, K)).astype(dt)
    norm = (mx.random.uniform(0.5, 1.5, (K,)).astype(dt), 1e-5) if epi in ("norm", "silu") else None
    res = mx.random.normal((B, 1, N // 2 if epi == "silu" else N)).astype(dt) if epi == "residual" else None
    split = N // 2 if epi == "silu" else None
    ref = to_np(G.linear(lin, x, norm=norm, residual=res, silu_split=split, use_kernel=False))
    assert ref.shape == (B, 1, split or N)
    mir = gemv_mirror(to_np(lin.weight), to_np(x).reshape(B, K), dt,
                      norm=(to_np(norm[0]), norm[1]) if norm else None,
                      residual=to_np(res).reshape(B, -1) if res is not None else None, silu_split=split,
                      ksplit=ksplit)
    rel = float(np.linalg.norm(mir.reshape(ref.shape) - ref) / np.linalg.norm(ref))
    assert rel < (1e-2 if dt == mx.bfloat16 else 1e-5), rel


def test_ksplit_for_keeps_warps_busy(monkeypatch):
    """K is split across 2 or 4 warps only where a projection has too few rows, and never
    below 2 iterations per warp; G.KSPLIT (experiments/gemv_sweep.py) overrides."""
    assert G.ksplit_for(2048, 2048, 2) == 4 and G.ksplit_for(4096, 4096, 2) == 2
    assert G.ksplit_for(8192, 2048, 2) == 1 and G.ksplit_for(128256, 2048, 2) == 1
    assert G.ksplit_for(64, 256, 2) == 1                 # one iteration of K: nothing to split
    monkeypatch.setattr(G, "KSPLIT", 2)
    assert G.ksplit_for(8192, 2048, 2) == 2


def test_gemv_mirror_catches_a_wrong_pairing():
    """Negative control: pairing gate row n with up row n+1 must fail the bound above."""
    K, N = 256, 16
    mx.random.seed(3)
    lin = nn.Linear(K, N, bias=False)
    lin.weight = (mx.random.normal((N, K)) * 0.05).astype(mx.float32)
    x = mx.random.normal((1, 1, K))
    ref = to_np(G.linear(lin, x, silu_split=N // 2, use_kernel=False)).reshape(1, -1)
    W = to_np(lin.weight)
    shifted = np.concatenate([W[:N // 2], np.roll(W[N // 2:], 1, axis=0)])
    mir = gemv_mirror(shifted, to_np(x).reshape(1, K), mx.float32, silu_split=N // 2)
    assert float(np.linalg.norm(mir - ref) / np.linalg.norm(ref)) > 0.1


def test_supports_float_linears_without_bias():
    assert G.supports(nn.Linear(64, 32, bias=False)) and G.is_float(nn.Linear(64, 32, bias=False))
    assert not G.supports(nn.Linear(64, 32, bias=True))
    assert not G.supports(nn.QuantizedLinear(64, 32, bias=False))     # (MLX's own matmul)
    assert G.supports(nn.Embedding(100, 64))


def test_standin_off_gpu_and_errors():
    lin = nn.Linear(64, 32, bias=False)
    x = mx.random.normal((1, 1, 64))
    # off the GPU (or with use_kernel=False) the stand-in is the module itself
    assert mx.array_equal(G.linear(lin, x), lin(x))
    h = mx.random.normal((1, 1, 32))
    assert mx.array_equal(G.linear(lin, x, residual=h), h + lin(x))
    w = mx.ones((64,))
    assert mx.array_equal(G.linear(lin, x, norm=(w, 1e-6)), lin(mx.fast.rms_norm(x, w, 1e-6)))


def qkv_rope_mirror(W, x, nw, eps, inv_freq, pos, H, Hkv, D, dt):
    """gemv_main.cu + gemv_rope_epilogue.cu in numpy: warp w -> rows (head*D + i, head*D + i + D/2) of head
    w // (D/2), i = w % (D/2); normalised dot products, rounded, then rotated."""
    K = W.shape[1]
    half = D // 2
    nh = H + 2 * Hkv
    inv = 1.0 / np.sqrt(np.float32(x @ x) / K + np.float32(eps))
    xs = x * nw
    q, k, v = (np.zeros((n, D), np.float32) for n in (H, Hkv, Hkv))
    for w in range(nh * half):
        head, i = w // half, w % half
        r1, r2 = head * D + i, head * D + i + half
        x1, x2 = round_to(np.float32(W[r1] @ xs) * inv, dt), round_to(np.float32(W[r2] @ xs) * inv, dt)
        if head >= H + Hkv:
            v[head - H - Hkv, [i, i + half]] = round_to(np.array([x1, x2]), dt)
            continue
        th = np.float32(pos) * inv_freq[i]
        c, s = np.cos(th), np.sin(th)
        dst = q[head] if head < H else k[head - H]
        dst[i], dst[i + half] = round_to(x1 * c - x2 * s, dt), round_to(x1 * s + x2 * c, dt)
    return q, k, v


@pytest.mark.parametrize("pos", [0, 37])
def test_qkv_rope_mirror_matches_standin(pos):
    from engine.fast import kernels as K
    H, Hkv, D, Kd = 4, 2, 16, 256
    mx.random.seed(pos + 1)
    lin = nn.Linear(Kd, (H + 2 * Hkv) * D, bias=False)
    lin.weight = (mx.random.normal(lin.weight.shape) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((1, 1, Kd)).astype(mx.bfloat16)
    nw = mx.random.uniform(0.5, 1.5, (Kd,)).astype(mx.bfloat16)
    rope = nn.RoPE(D, base=10000.0)
    inv_freq = K.rope_inv_freq(rope, D)
    p = mx.array([pos], dtype=mx.int32)
    qkv = G.linear(lin, x, norm=(nw, 1e-5))
    ref = K.rope_qkv(qkv, inv_freq, p, H, Hkv, D, rope, use_kernel=False)
    mir = qkv_rope_mirror(to_np(lin.weight), to_np(x).reshape(-1), to_np(nw), 1e-5, to_np(inv_freq), pos,
                          H, Hkv, D, mx.bfloat16)
    for got, want in zip(mir, ref):
        want = to_np(want).reshape(got.shape)
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-2
    # the wrong position (the negative control's fault) is visible
    bad = qkv_rope_mirror(to_np(lin.weight), to_np(x).reshape(-1), to_np(nw), 1e-5, to_np(inv_freq), pos + 1,
                          H, Hkv, D, mx.bfloat16)
    want = to_np(ref[0]).reshape(bad[0].shape)
    assert float(np.linalg.norm(bad[0] - want) / np.linalg.norm(want)) > 1e-2


def test_qkv_rope_mirror_per_row_positions():
    """Rows of the batch at their own positions (PER_ROW): row b is rotated at pos[b]."""
    from engine.fast import kernels as K
    H, Hkv, D, Kd = 2, 1, 16, 256
    mx.random.seed(5)
    lin = nn.Linear(Kd, (H + 2 * Hkv) * D, bias=False)
    lin.weight = (mx.random.normal(lin.weight.shape) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((2, 1, Kd)).astype(mx.bfloat16)
    nw = mx.ones((Kd,), mx.bfloat16)
    rope = nn.RoPE(D, base=10000.0)
    inv_freq = K.rope_inv_freq(rope, D)
    pos = mx.array([3, 40], dtype=mx.int32)
    ref = K.rope_qkv(G.linear(lin, x, norm=(nw, 1e-5)), inv_freq, pos, H, Hkv, D, rope, use_kernel=False)
    for b in range(2):
        mir = qkv_rope_mirror(to_np(lin.weight), to_np(x[b]).reshape(-1), to_np(nw), 1e-5, to_np(inv_freq),
                              int(pos[b]), H, Hkv, D, mx.bfloat16)
        for got, want in zip(mir, ref):
            want = to_np(want[b]).reshape(got.shape)
            assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-2
