"""Parts of the GEMV kernel's numpy mirror (tests/engine/test_fast_gemv.py)."""

import mlx.core as mx
import numpy as np


def to_np(a):
    return np.array(a.astype(mx.float32))


def round_to(a, dt):
    return to_np(mx.array(np.asarray(a, np.float32)).astype(dt))


def epilogue_mirror(row_sum, n, b, K, dt, norm, residual, silu_split):
    """GEMV_EPILOGUE for output (n, b): `row_sum(row)` gives a weight row's reduced
    (sum, sum of squares); the norm as a scale, then the SiLU·up or residual epilogue,
    with the kernel's roundings."""
    g, ss = row_sum(n)
    inv = 1.0 / np.sqrt(ss / K + np.float32(norm[1])) if norm is not None else 1.0
    g = round_to(g * inv, dt)
    if silu_split is not None:
        u = round_to(row_sum(silu_split + n)[0] * inv, dt)
        v = round_to(g / (1 + np.exp(-g)), dt) * u
    elif residual is not None:
        v = residual[b, n] + g
    else:
        v = g
    return round_to(v, dt)
