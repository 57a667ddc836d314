"""The quantized fused GEMV (engine/fast/qgemv.py), checked on the CPU.

Its decomposition is mirrored in numpy: a warp per output row (gate row paired with up row
for SiLU·up), lane l reading the packed words of elements [k0, k0 + EPL) with
k0 = (it*32 + l) * EPL, unpacking element j of a word from bits [BITS*j, BITS*(j+1)),
scale * Σ q·x + bias * Σ x per lane-read (each inside one group), the norm applied as a
scale at the end, and the shared epilogue's roundings. In float32 the mirror is compared
with the stock path (the QuantizedLinear itself; bound 1e-5): a wrong bit order, group
index or pairing shows up as a large error. In bf16 it is compared with the exact product
of the dequantized weights (bound 1e-2): MLX's own bf16 quantized matmul on the CPU is
itself 3-4% away from that product (it rounds along the way), too far to be the reference.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.fast import gemv as G
from engine.fast import qgemv as Q

from gemv_mirror import epilogue_mirror, to_np


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    monkeypatch.setattr(Q, "ENABLED", True)


def qgemv_mirror(ql, x, dt, norm=None, residual=None, silu_split=None, bit_order=1):
    bits, gs = ql.bits, ql.group_size
    words = np.array(ql.weight).view(np.uint32)
    sc, bi = to_np(ql.scales), to_np(ql.biases)
    per = 32 // bits
    epl = 4 * per
    K = words.shape[1] * per
    B = x.shape[0]
    nout = silu_split or words.shape[0]
    nw = norm[0] if norm is not None else np.ones(K, np.float32)
    shifts = [bits * e for e in range(per)][::bit_order]

    def unpack(row, k0):
        ws = words[row, k0 // per: k0 // per + 4]
        return np.array([(int(w) >> s) & ((1 << bits) - 1) for w in ws for s in shifts], np.float32)

    out = np.zeros((B, nout), np.float32)
    for n in range(nout):
        for b in range(B):
            def row_sum(row):
                acc, ss = np.zeros(32, np.float32), np.zeros(32, np.float32)
                for lane in range(32):
                    for it in range(-(-K // (32 * epl))):
                        k0 = (it * 32 + lane) * epl
                        if k0 >= K:
                            continue
                        xs = x[b, k0:k0 + epl]
                        ss[lane] += np.float32(xs @ xs)
                        xn = xs * nw[k0:k0 + epl]
                        g = k0 // gs
                        acc[lane] += sc[row, g] * np.float32(unpack(row, k0) @ xn) + bi[row, g] * xn.sum()
                return np.float32(acc.sum()), np.float32(ss.sum())
            out[b, n] = epilogue_mirror(row_sum, n, b, K, dt, norm, residual, silu_split)
    return out


def _qlinear(K, N, bits, gs, dt, seed):
    mx.random.seed(seed)
    lin = nn.Linear(K, N, bias=False)
    lin.weight = (mx.random.normal((N, K)) * 0.05).astype(dt)
    return nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits)


@pytest.mark.parametrize("bits,gs,epi", [(4, 64, "norm"), (4, 32, "silu"), (8, 64, "residual"),
                                         (8, 32, "plain")])
def test_qgemv_mirror_matches_standin(bits, gs, epi):
    K, N, B, dt = 1024, 12, 2, mx.float32
    ql = _qlinear(K, N, bits, gs, dt, bits + gs)
    assert Q.supports(ql) and G.supports(ql) and not G.is_float(ql) and Q.in_features(ql) == K
    x = mx.random.normal((B, 1, K)).astype(dt)
    norm = (mx.random.uniform(0.5, 1.5, (K,)).astype(dt), 1e-5) if epi in ("norm", "silu") else None
    res = mx.random.normal((B, 1, N)).astype(dt) if epi == "residual" else None
    split = N // 2 if epi == "silu" else None
    ref = to_np(G.linear(ql, x, norm=norm, residual=res, silu_split=split, use_kernel=False)).reshape(B, -1)
    kw = dict(norm=(to_np(norm[0]), norm[1]) if norm else None,
              residual=to_np(res).reshape(B, -1) if res is not None else None, silu_split=split)
    mir = qgemv_mirror(ql, to_np(x).reshape(B, K), dt, **kw)
    assert float(np.linalg.norm(mir - ref) / np.linalg.norm(ref)) < 1e-5
    # negative control: the words' elements read in the wrong order
    bad = qgemv_mirror(ql, to_np(x).reshape(B, K), dt, bit_order=-1, **kw)
    assert float(np.linalg.norm(bad - ref) / np.linalg.norm(ref)) > 5e-2


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32)])
def test_qgemv_mirror_bf16_against_the_dequantized_product(bits, gs):
    K, N, B, dt = 1024, 12, 2, mx.bfloat16
    ql = _qlinear(K, N, bits, gs, dt, 40)
    x = mx.random.normal((B, 1, K)).astype(dt)
    W = to_np(mx.dequantize(ql.weight, ql.scales, ql.biases, group_size=gs, bits=bits)).astype(np.float64)
    exact = to_np(x).reshape(B, K).astype(np.float64) @ W.T
    mir = qgemv_mirror(ql, to_np(x).reshape(B, K), dt)
    assert float(np.linalg.norm(mir - exact) / np.linalg.norm(exact)) < 1e-2


def test_qgemv_is_opt_in(monkeypatch):
    monkeypatch.setattr(Q, "ENABLED", False)
    ql = _qlinear(256, 8, 4, 64, mx.bfloat16, 0)
    assert not Q.supports(ql) and not G.supports(ql)


def test_qgemv_supports():
    assert Q.supports(_qlinear(256, 8, 4, 64, mx.bfloat16, 0))
    assert not Q.supports(nn.Linear(256, 8, bias=False))
    q3 = nn.QuantizedLinear(256, 8, bias=False, group_size=64, bits=3)
    assert not Q.supports(q3)
