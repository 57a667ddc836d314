"""The CUDA kernels' decomposition, checked on the CPU.

The kernels themselves need an NVIDIA GPU (experiments/l3_kernel_check.py runs them
against their references there). Here each kernel's index arithmetic and reduction
scheme is mirrored in numpy, loop for loop (blocks, warps, key chunks, online
softmax, the two-pass combine; RoPE's thread -> (row, head, pair) map and its
inverse frequencies), and compared with the stock-MLX reference path that the CPU
runs: a wrong chunk bound, pairing or frequency shows up as a large error, while
float32-vs-bf16 rounding stays far under the bounds used here (relative error < 1e-2,
the bf16 bound of a kernel check)."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.fast import kernels as K
from engine.models.base import FreqRoPE, _llama3_freqs


def _np(a):
    return np.array(a.astype(mx.float32))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def attention_mirror(q, k, v, length, scale, ns, drop=0, start=None):
    """engine/fast/cuda/attn_partial.cu + attn_combine.cu, in numpy float32: per block (row b,
    head h, chunk s), keys from the row's start column (its left padding) to length."""
    B, H, D = q.shape[0], q.shape[1], q.shape[3]
    Hkv = k.shape[1]
    n = length - drop
    out = np.zeros((B, H, 1, D), np.float32)
    for b in range(B):
        lo = 0 if start is None else int(start[b])
        chunk = (n - lo + ns - 1) // ns
        for h in range(H):
            kvh = h // (H // Hkv)
            qf = q[b, h, 0] * np.float32(scale)
            parts = []
            for s in range(ns):
                j0 = lo + s * chunk
                j1 = min(n, j0 + chunk)
                warps = []
                for w in range(8):
                    m, l, acc = np.float32(-1e30), np.float32(0), np.zeros(D, np.float32)
                    for j in range(j0 + w, j1, 8):
                        dot = np.float32(qf @ k[b, kvh, j])
                        mn = max(m, dot)
                        corr, p = np.exp(m - mn), np.exp(dot - mn)
                        l = l * corr + p
                        acc = acc * corr + p * v[b, kvh, j]
                        m = mn
                    warps.append((m, l, acc))
                M = max(w[0] for w in warps)
                parts.append((M, sum(w[1] * np.exp(w[0] - M) for w in warps),
                              sum(w[2] * np.exp(w[0] - M) for w in warps)))
            M = max(p[0] for p in parts)
            L = sum(p[1] * np.exp(p[0] - M) for p in parts)
            out[b, h, 0] = sum(p[2] * np.exp(p[0] - M) for p in parts) / L
    return out


@pytest.mark.parametrize("cap,length", [(256, 1), (256, 100), (512, 400), (1024, 1024), (2560, 777)])
def test_attention_split_k_scheme(cap, length):
    mx.random.seed(cap + length)
    H, Hkv, D = 4, 2, 32
    q, k, v = (mx.random.normal(s).astype(mx.bfloat16)
               for s in ((1, H, 1, D), (1, Hkv, cap, D), (1, Hkv, cap, D)))
    ln = mx.array([length], dtype=mx.int32)
    ref = _np(K.decode_attention(q, k, v, ln, D ** -0.5, use_kernel=False))
    got = attention_mirror(_np(q), _np(k), _np(v), length, D ** -0.5, K.n_splits(cap))
    assert _rel(got, ref) < 1e-2
    # and the negative control's fault is visible in the same mirror
    if length > 1:
        bad = attention_mirror(_np(q), _np(k), _np(v), length, D ** -0.5, K.n_splits(cap), drop=1)
        assert _rel(bad, ref) > 1e-2


@pytest.mark.parametrize("cap,length,starts", [(512, 40, [0, 13, 39]), (1024, 700, [5, 650, 0]),
                                               (2560, 2049, [2000, 0, 1])])
def test_attention_per_row_start_columns(cap, length, starts):
    """Rows of the batch: row b attends over columns [start[b], length) (left padding)."""
    mx.random.seed(cap + length)
    B, H, Hkv, D = len(starts), 4, 2, 32
    q, k, v = (mx.random.normal(s).astype(mx.bfloat16)
               for s in ((B, H, 1, D), (B, Hkv, cap, D), (B, Hkv, cap, D)))
    ln, st = mx.array([length], dtype=mx.int32), mx.array(starts, dtype=mx.int32)
    ref = _np(K.decode_attention(q, k, v, ln, D ** -0.5, use_kernel=False, start=st))
    got = attention_mirror(_np(q), _np(k), _np(v), length, D ** -0.5, K.n_splits(cap), start=starts)
    assert _rel(got, ref) < 1e-2
    # each row equals attention over its own columns alone (no mask, no padding)
    for b, lo in enumerate(starts):
        one = mx.fast.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, lo:length],
                                                   v[b:b + 1, :, lo:length], scale=D ** -0.5)
        assert _rel(_np(one)[0], ref[b]) < 1e-2
    # a start ignored (every row from column 0) is visible
    assert _rel(attention_mirror(_np(q), _np(k), _np(v), length, D ** -0.5, K.n_splits(cap)),
                ref) > 1e-2


def rope_mirror(qkv, inv_freq, pos, H, Hkv, D):
    """engine/fast/cuda/rope_qkv.cu: one thread per (row, head, pair), non-traditional pairs (i, i+D/2);
    `pos` one position for every row, or one per row (PER_ROW)."""
    half, nh = D // 2, H + 2 * Hkv
    B = qkv.shape[0]
    pos = np.atleast_1d(pos)
    q = np.zeros((B, H, 1, D), np.float32)
    k = np.zeros((B, Hkv, 1, D), np.float32)
    v = np.zeros((B, Hkv, 1, D), np.float32)
    src = qkv.reshape(-1)
    for gid in range(B * nh * half):
        i, head, b = gid % half, (gid // half) % nh, gid // (half * nh)
        base = b * nh * D + head * D
        x1, x2 = src[base + i], src[base + i + half]
        if head >= H + Hkv:
            v[b, head - H - Hkv, 0, [i, i + half]] = x1, x2
            continue
        th = np.float32(pos[b if pos.size > 1 else 0]) * inv_freq[i]
        c, s = math.cos(th), math.sin(th)
        dst = q[b, head, 0] if head < H else k[b, head - H, 0]
        dst[i], dst[i + half] = x1 * c - x2 * s, x1 * s + x2 * c
    return q, k, v


ROPES = {
    "base": lambda d: nn.RoPE(d, base=500000.0),
    "linear-scaled": lambda d: nn.RoPE(d, base=10000.0, scale=0.25),
    "llama3": lambda d: FreqRoPE(d, _llama3_freqs(d, 500000.0, {"factor": 8.0})),
}


@pytest.mark.parametrize("kind", list(ROPES))
@pytest.mark.parametrize("pos", [0, 5, 2047])
def test_rope_thread_map_and_frequencies(kind, pos):
    H, Hkv, D = 4, 2, 64
    rope = ROPES[kind](D)
    qkv = mx.random.normal((1, 1, (H + 2 * Hkv) * D)).astype(mx.float32)
    p = mx.array([pos], dtype=mx.int32)
    ref = K.rope_qkv(qkv, None, p, H, Hkv, D, rope, use_kernel=False)
    got = rope_mirror(_np(qkv), _np(K.rope_inv_freq(rope, D)), pos, H, Hkv, D)
    for g, r in zip(got, ref):
        assert _rel(g, _np(r)) < 1e-3


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_per_row_positions(kind):
    """Rows of the batch: row b rotated at its own position pos[b]."""
    H, Hkv, D = 4, 2, 64
    rope = ROPES[kind](D)
    pos = [0, 7, 2047]
    qkv = mx.random.normal((len(pos), 1, (H + 2 * Hkv) * D)).astype(mx.float32)
    ref = K.rope_qkv(qkv, None, mx.array(pos, dtype=mx.int32), H, Hkv, D, rope, use_kernel=False)
    got = rope_mirror(_np(qkv), _np(K.rope_inv_freq(rope, D)), np.array(pos), H, Hkv, D)
    for g, r in zip(got, ref):
        assert _rel(g, _np(r)) < 1e-3
    # one position for all rows is the solo step's call, and differs here
    one = rope_mirror(_np(qkv), _np(K.rope_inv_freq(rope, D)), pos[1], H, Hkv, D)
    assert _rel(one[0], _np(ref[0])) > 1e-3
    with pytest.raises(ValueError, match="positions"):
        K.rope_qkv(qkv, None, mx.array([1, 2], dtype=mx.int32), H, Hkv, D, rope, use_kernel=False)


def test_rope_kernel_refuses_what_it_cannot_do():
    with pytest.raises(ValueError):
        K.rope_inv_freq(nn.RoPE(32, traditional=True), 32)
    with pytest.raises(ValueError):
        K.rope_inv_freq(nn.RoPE(16), 32)          # partial rotation


def test_add_rms_norm_mirror():
    D = 2048
    x, r = mx.random.normal((1, 1, D)).astype(mx.bfloat16), mx.random.normal((1, 1, D)).astype(mx.bfloat16)
    w = (1 + 0.1 * mx.random.normal((D,))).astype(mx.bfloat16)
    h_ref, y_ref = K.add_rms_norm(x, r, w, 1e-5, use_kernel=False)
    h = _np((x + r))                               # the kernel rounds h to T before squaring
    inv = 1.0 / np.sqrt((h.astype(np.float64) ** 2).sum() / D + 1e-5)
    y = _np(w) * _np(mx.array(h * inv).astype(mx.bfloat16))
    assert np.array_equal(h, _np(h_ref))
    assert _rel(y, _np(y_ref)) < 1e-2


def test_off_gpu_the_decoder_runs_the_references():
    """Off the GPU the fast step runs the stock-MLX references (no CUDA kernel), and a
    decode step through them gives the L1 forward's logits exactly."""
    from engine.fast.decode import FastDecoder, FastStep
    from engine.levers import resolve
    from engine.loader import load_model
    from parity.fixtures.models import ensure_fixture

    if mx.default_device() == mx.gpu:
        pytest.skip("this checks the CPU fallback")
    assert not K.cuda_available()
    path = ensure_fixture("llama", "bfloat16")
    model, ref = load_model(path)[0], load_model(path)[0]
    dec = FastDecoder(FastStep(model, resolve("l3", env={})))
    assert dec.stats is dec.step.stats
    assert dec.stats.kernels is False and dec.stats.attn_kernel is False
    prompt = mx.array([[1, 5, 9, 2]])
    caches, ref_caches = model.make_cache(), ref.make_cache()
    mx.eval(model(prompt, cache=caches), ref(prompt, cache=ref_caches))
    got = dec(mx.array([7]), caches)
    want = ref(mx.array([[7]]), cache=ref_caches)[:, -1, :]
    assert mx.array_equal(got.reshape(want.shape), want)
    assert dec.stats.steps == 1 and dec.stats.kernels is False and dec.stats.mega is False


def test_empty_kernels_are_separate_kernels():
    """experiments/l3_overhead.py's emptied kernels are built under another name (they never
    replace the real ones) and return before doing anything."""
    src = "  b[0] = a[0];\n"
    assert K.kernel_variant("mlxp_x", src) == ("mlxp_x", src)
    with K.empty_kernels():
        name, body = K.kernel_variant("mlxp_x", src)
    assert name == "mlxp_x_empty" and body.strip().startswith("if (threadIdx.x < 100000) return;")
    assert body.endswith(src) and K.kernel_variant("mlxp_x", src) == ("mlxp_x", src)


def test_fault_builds_are_other_kernels(monkeypatch):
    """Inside inject_fault a kernel whose source reads the fault's macro is built as another
    kernel, the macro defined in its header; the production kernel's name and header carry no
    fault, and kernels that do not read the macro are the production ones."""
    from engine.fast.sources import source
    built = []
    monkeypatch.setattr(K, "_kernels", {})
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: built.append(kw) or kw["name"])
    rope, hdr = source("rope_qkv.cu"), source("faults.cuh")
    assert K.cuda_kernel("mlxp_rope_qkv", ["qkv"], ["q"], rope, hdr) == "mlxp_rope_qkv"
    with K.inject_fault("rope_pos_plus_one"):
        assert K.cuda_kernel("mlxp_rope_qkv", ["qkv"], ["q"], rope, hdr) == "mlxp_rope_qkv_rope_pos_plus_one"
        assert K.cuda_kernel("mlxp_add_rms", ["x"], ["h"], source("add_rms.cu")) == "mlxp_add_rms"
    with K.inject_fault("attn_drop_last_key"):       # (this fault is not RoPE's)
        assert K.cuda_kernel("mlxp_rope_qkv", ["qkv"], ["q"], rope, hdr) == "mlxp_rope_qkv"
    prod, fault = built[0], built[1]
    assert "#define L3_FAULT_SHIFT 1" not in prod["header"] and "L3_FAULT_SHIFT" in prod["source"]
    assert fault["header"].startswith("#define L3_FAULT_SHIFT 1\n") and fault["source"] == rope
    assert len(built) == 3                            # (the production kernels were reused)


def test_sources_are_the_cuda_files_with_their_includes_inlined():
    from engine.fast.sources import DIR, source
    single = source("attn_single.cu")
    assert "#include" not in single and (DIR / "attn_chunk.cu").read_text() in single
    assert "#include" not in source("mega_step.cu") and "mega_qkv" not in source("mega_device.cuh")
    for bad in ("nope.cu", "../kernels.py"):
        with pytest.raises(FileNotFoundError):
            source(bad)


def test_the_cuda_files_are_package_data():
    """An installed engine has its kernels: pyproject ships every file of engine/fast/cuda."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from engine.fast.sources import DIR
    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["engine.fast"]
    files = [p.relative_to(DIR.parent).as_posix() for p in DIR.iterdir()]
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), (files, patterns)
