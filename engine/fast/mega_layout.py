"""Sizes of the one-kernel step's workspace and shared memory (engine/fast/cuda/mega_step.cu
lays them out; engine.fast.mega asks for them)."""

from __future__ import annotations

MAXCH = 64          # chunks of the cache per query head in phase B (at most)
WPB = 512 // 32     # warps a block (mega_cuda.THREADS)


def workspace_floats(H: int, n_heads: int, head_dim: int, inter: int, n_layers: int, rows: int = 1,
                     blocks: int = 0) -> int:
    """Floats of the workspace for `rows` rows: barrier counter (32), then per row h, q,
    SiLU·up output, attention output; per-layer chunk counters, attention partials, the
    keys before their norm (q/k norms), the per-layer head flags (FLOW), a region no longer
    used (`unused_words`: the kernel's UNUSED), then the PROF stamps and (`blocks` > 0, with
    PROF) each block's arrival at each phase's end."""
    return (32 + rows * (H + 2 * n_heads * head_dim + inter) + (n_layers * rows * n_heads + 3) // 4 * 4
            + rows * n_heads * MAXCH * (head_dim + 4) + rows * n_heads * head_dim
            + (n_layers * 3 * n_heads + 3) // 4 * 4 + unused_words(H, n_heads, head_dim, n_layers)
            + 2 * n_stamps(n_layers) * (1 + blocks))


def unused_words(H: int, n_heads: int, head_dim: int, n_layers: int) -> int:
    """Words of the workspace the kernel leaves unused (its UNUSED): where variants of the kernel
    since taken out kept their counters (reports/l3/JOURNAL.md); kept so that the default
    kernel's addresses, and its compiled code, are those measured."""
    return (n_heads * head_dim + (n_layers * 5 + 1) * 8 + n_heads * H + n_layers * (H // 4)
            + n_layers * n_heads + n_layers * 8 + H + 4 * n_layers)


def n_stamps(n_layers: int) -> int:
    """PROF time stamps: the start, the end of each of a layer's 5 phases, the head's end."""
    return 2 + 5 * n_layers


def input_bytes(H: int, n_heads: int, head_dim: int, inter: int, itemsize: int, rows: int = 1) -> int:
    """Shared memory for the phase inputs of `rows` rows (the largest of them; the kernel's XBYTES)."""
    return (rows * max(4 * H, 4 * n_heads * head_dim, itemsize * inter) + 15) // 16 * 16


def shared_bytes(H: int, n_heads: int, head_dim: int, inter: int, itemsize: int, rows: int = 1) -> int:
    """Dynamic shared memory of the kernel of `rows` rows: the phase inputs."""
    return input_bytes(H, n_heads, head_dim, inter, itemsize, rows)


def static_bytes(head_dim: int, rows: int = 1) -> int:
    """Static shared memory of the kernel of `rows` rows (its __shared__ arrays: the block's
    sums and norms, the FLOW query slots; 16 bytes more), rounded up to the next KB for the compiler's own."""
    n = 4 * (WPB * rows + rows + WPB * head_dim) + 16
    return (n + 1024 + 1023) // 1024 * 1024


ATTR_MIN = 48000    # MLX raises a kernel's dynamic shared memory limit only for requests above this


def launch_shared(dynamic: int, static: int) -> int:
    """The dynamic shared memory to ask for: `dynamic`, or where static and dynamic together
    pass the 48 KB a launch gets without a raised limit while `dynamic` alone would not make MLX
    raise it, just over ATTR_MIN (the launch would fail: invalid argument)."""
    if dynamic + static > 48 * 1024 and dynamic <= ATTR_MIN:
        return (ATTR_MIN + 16) // 16 * 16
    return dynamic


SHARED_MAX = 200 * 1024     # dynamic shared memory a block may ask for (H100/H200: 227 KB)
MAX_ROWS = 8                # rows per kernel call (more: several calls, one per group)


def rows_per_call(H: int, n_heads: int, head_dim: int, inter: int, itemsize: int) -> int:
    """Rows one call takes: at most MAX_ROWS, and what SHARED_MAX holds."""
    per = input_bytes(H, n_heads, head_dim, inter, itemsize)
    return max(0, min(MAX_ROWS, SHARED_MAX // per))
