"""Pieces of the fast decode step (engine.fast.decode.FastStep).

- `KernelChoice.for_model`: which kernels a step uses for this model and levers (merging
  the projections where `merged_proj` is on);
- `rotated_qkv`: one token's q, k, v per row out of a layer's projections, q and k rotated
  at the given positions (one for every row, or one per row);
- `layer_stack`: embedding, the decoder layers with each residual add folded into the
  next RMSNorm (`kernels.add_rms_norm`), and the head; attention is the caller's (each step
  has its own cache layout);
- `gemv_ok` / `gemv_stack`: the same with every projection through `engine.fast.gemv`
  (norm, RoPE, SiLU·up and residual adds fused into them), where the model allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx

from ..levers import Levers
from ..models.base import silu_gate
from . import gemv as G
from . import kernels as K
from .merge import merge_projections, merged_of


@dataclass(frozen=True)
class KernelChoice:
    use_kernels: bool                 # perf_kernel on a CUDA device: the fused kernels (else stand-ins)
    use_attn_kernel: bool             # the decode-attention CUDA kernel
    inv_freq: Optional[mx.array]      # the RoPE step's inverse frequencies (None: the model's RoPE)
    # RoPE's inverse frequencies for the one-kernel step (engine.fast.mega), which also
    # applies q/k norms (None: kernels off)
    mega_freq: Optional[mx.array] = None
    add_rms: bool = False             # the residual add + RMSNorm CUDA kernel
    rope_kernel: bool = False         # the RoPE CUDA kernel (inv_freq given, else its stand-in)

    @classmethod
    def for_model(cls, model, levers: Levers) -> "KernelChoice":
        """The kernels run only on an NVIDIA GPU; the RoPE kernel works on the merged q/k/v
        output, so not for models with q/k norms (qwen3; the one-kernel step applies them
        itself). Merges the projections first where `merged_proj` is on."""
        cuda = K.cuda_available()
        if levers.merged_proj:
            merge_projections(model)
        uk = levers.perf_kernel and cuda
        off = levers.fast.disabled
        a0 = model.layers[0].self_attn
        freq = K.rope_inv_freq(a0.rope, a0.head_dim) if uk else None
        return cls(uk, levers.fused_sdpa and cuda and "attention" not in off,
                   None if hasattr(a0, "q_norm") else freq, freq,
                   add_rms=uk and "add_rms" not in off, rope_kernel=uk and "rope_qkv" not in off)


def rotated_qkv(attn, x: mx.array, pos: mx.array, inv_freq: Optional[mx.array], rope_kernel: bool = True):
    """q [B,H,1,D], k and v [B,Hkv,1,D] for x [B,1,hidden], rotated at pos ([1] or [B]).

    With `inv_freq` (the RoPE step in use) and the layer's q/k/v merged, the merged
    projection's output goes through `kernels.rope_qkv` (its CUDA kernel with `rope_kernel`);
    otherwise the layer's own projections, q/k norms (qwen3) and RoPE module run."""
    B = x.shape[0]
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    merged = merged_of(attn, ("q_proj", "k_proj", "v_proj")) if inv_freq is not None else None
    if merged is not None:
        return K.rope_qkv(merged.linear(x), inv_freq, pos, H, Hkv, D, attn.rope, rope_kernel)
    q = attn.q_proj(x).reshape(B, 1, H, D)
    k = attn.k_proj(x).reshape(B, 1, Hkv, D)
    v = attn.v_proj(x).reshape(B, 1, Hkv, D).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    p = pos + 1 if K.active_fault() == "rope_pos_plus_one" else pos
    q = attn.rope(q.transpose(0, 2, 1, 3), offset=p)
    return q, attn.rope(k.transpose(0, 2, 1, 3), offset=p), v


def layer_stack(model, tokens: mx.array, attend: Callable, use_kernels: bool) -> mx.array:
    """Logits [B, V] for one token per row (tokens [B]); `attend(i, attn, x)` returns
    layer i's attention output [B, 1, hidden] for its normed input x."""
    h = model.embed(tokens[:, None])
    resid = None
    for i, layer in enumerate(model.layers):
        ln = layer.input_layernorm
        if resid is None:
            x = ln(h)
        else:
            h, x = K.add_rms_norm(h, resid, ln.weight, ln.eps, use_kernels)
        a = attend(i, layer.self_attn, x)
        ln = layer.post_attention_layernorm
        h, x = K.add_rms_norm(h, a, ln.weight, ln.eps, use_kernels)
        resid = layer.mlp(x)
    return model.head(h + resid)[:, -1, :]


def gemv_ok(model, levers: Levers) -> bool:
    """Whether every projection can go through the fused GEMV (perf_kernel on, q/k/v and
    gate/up merged, plain float or 4-bit weights without bias — 4-bit unless the `qmm`
    kernel is switched off —, SiLU gating)."""
    if not levers.perf_kernel or "gemv" in levers.fast.disabled:
        return False
    ok = G.is_float if "qmm" in levers.fast.disabled else G.supports
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = merged_of(attn, ("q_proj", "k_proj", "v_proj"))
        gu = merged_of(mlp, ("gate_proj", "up_proj"))
        if qkv is None or gu is None or getattr(mlp, "act", None) is not silu_gate:
            return False
        if not all(ok(m) for m in (qkv.linear, gu.linear, attn.o_proj, mlp.down_proj)):
            return False
    return ok(model.head_parts()[1])


def gemv_qkv(layer, h: mx.array, pos: mx.array, inv_freq: Optional[mx.array], use_kernels: bool,
             rope_kernel: bool = True):
    """q [B,H,1,D], k and v [B,Hkv,1,D] from the residual stream h: RMSNorm, the merged
    q/k/v projection and RoPE at pos ([1] or [B]) in one kernel where the RoPE kernel is in
    use, else the GEMV and the layer's own q/k norms and RoPE."""
    attn, ln = layer.self_attn, layer.input_layernorm
    B = h.shape[0]
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    merged = merged_of(attn, ("q_proj", "k_proj", "v_proj")).linear
    shift = 1 if K.active_fault() == "rope_pos_plus_one" else 0
    if (inv_freq is not None and rope_kernel and B <= G.MAX_ROWS
            and G.is_float(merged)):
        return G.qkv_rope(merged, h, (ln.weight, ln.eps), inv_freq, pos, H, Hkv, D)
    qkv = G.linear(merged, h, norm=(ln.weight, ln.eps), use_kernel=use_kernels)
    if inv_freq is not None:                 # (the RoPE step after the GEMV)
        return K.rope_qkv(qkv, inv_freq, pos, H, Hkv, D, attn.rope, rope_kernel)
    q, k, v = mx.split(qkv, [H * D, (H + Hkv) * D], axis=-1)
    q, k = q.reshape(B, 1, H, D), k.reshape(B, 1, Hkv, D)
    v = v.reshape(B, 1, Hkv, D).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    p = pos + shift if shift else pos
    return attn.rope(q.transpose(0, 2, 1, 3), offset=p), attn.rope(k.transpose(0, 2, 1, 3), offset=p), v


def write_rows(buf: mx.array, x: mx.array, cols: mx.array, crow: Optional[mx.array] = None) -> mx.array:
    """buf [S, Hkv, CAP, D] with row b's x [b, :, 0, :] written at column cols[b] (cols: [B],
    or [1] for every row) of buffer row b, or of buffer row crow[b] (crow [B]: rows of a verify
    sharing a slot, engine.fast.slots)."""
    B = x.shape[0]
    if crow is not None:           # (a scatter over the buffer's (row, head, column) lines)
        S, Hkv, cap, D = buf.shape
        line = (crow.reshape(B, 1) * Hkv + mx.arange(Hkv)[None]) * cap + cols.reshape(B, 1)
        flat = mx.put_along_axis(buf.reshape(S * Hkv * cap, D),
                                 mx.broadcast_to(line.reshape(B * Hkv, 1), (B * Hkv, D)),
                                 x.reshape(B * Hkv, D), axis=0)
        return flat.reshape(S, Hkv, cap, D)
    if cols.size == 1:
        return mx.slice_update(buf, x, cols.reshape(1), axes=(2,))
    idx = mx.broadcast_to(cols.reshape(B, 1, 1, 1), x.shape)
    return mx.put_along_axis(buf, idx, x, axis=2)


def cached_attention(ks: list, vs: list, write_at: mx.array, length: mx.array, use_attn_kernel: bool,
                     start: Optional[mx.array] = None, crow: Optional[mx.array] = None) -> Callable:
    """`attend(i, attn, q, k, v)` for `gemv_stack` over per-layer buffers (lists updated in
    place): row b's k and v written at column `write_at[b]` (or `write_at[0]` for every row)
    of buffer row b (or crow[b]), attention over columns [start, length) of that buffer row
    (length and start: one for every row, or one a row), output [B, 1, H*D]. Every row's keys
    are written before any row attends, so a verify's rows of one slot see each other's."""
    def attend(i, attn, q, k, v):
        ks[i] = write_rows(ks[i], k, write_at, crow)
        vs[i] = write_rows(vs[i], v, write_at, crow)
        o = K.decode_attention(q, ks[i], vs[i], length, attn.scale, use_attn_kernel, start=start,
                               crow=crow)
        return o.transpose(0, 2, 1, 3).reshape(q.shape[0], 1, -1)
    return attend


def gemv_stack(model, tokens: mx.array, attend: Callable, pos: mx.array, inv_freq: Optional[mx.array],
               use_kernels: bool, rope_kernel: bool = True) -> mx.array:
    """Logits [B, V] for one token per row. Per layer: GEMV(norm -> q/k/v [+ RoPE]),
    `attend(i, attn, q, k, v)` (the caller's cache write and attention, returning
    [B, 1, H*D]), GEMV(o_proj + h), GEMV(norm -> gate/up -> SiLU * up), GEMV(down_proj + h);
    then GEMV(norm -> head). Off the GPU every GEMV is the model's own operations."""
    uk = use_kernels
    h = model.embed(tokens[:, None])
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = gemv_qkv(layer, h, pos, inv_freq, uk, rope_kernel)
        o = attend(i, attn, q, k, v)
        h = G.linear(attn.o_proj, o, residual=h, use_kernel=uk)
        ln, mlp = layer.post_attention_layernorm, layer.mlp
        gu = merged_of(mlp, ("gate_proj", "up_proj"))
        act = G.linear(gu.linear, h, norm=(ln.weight, ln.eps), silu_split=gu.sizes[0],
                       gate_fn=mlp.act, use_kernel=uk)
        h = G.linear(mlp.down_proj, act, residual=h, use_kernel=uk)
    norm, out = model.head_parts()
    return G.linear(out, h, norm=(norm.weight, norm.eps), use_kernel=uk)[:, -1, :]
