"""Segmented backward and per-layer gradient checkpointing over the segment protocol.

Every engine model splits its forward as `h, ctx = model.begin(inputs)`,
`h = model.layer_step(i, h, ctx)`, `logits = model.head(h)`. On top of that:

**Segmented backward** (:func:`segmented_value_and_grad`). Blocks are cut into
consecutive segments of `segment_size` layers. The forward runs segment by
segment *without* autograd and keeps only detached boundaries (the hidden state
entering each segment, plus - for Gemma 4 KV sharing - the K/V of every donor
layer whose sharers sit in a later segment). The loss head runs under `mx.vjp`
with cotangent 1 and gives the cotangent of the last boundary; then, from the
last segment to the first, the segment is recomputed under `mx.vjp` w.r.t.
[boundary in, donor K/V read from earlier segments, the segment's LoRA params]
with cotangents [dh out, accumulated donor K/V cotangents]. The outputs thread
`dh` to the previous segment, add into the donor K/V cotangent accumulators
(summed over all sharer segments) and give the segment's parameter gradients.
Only one segment's activations are live at a time.

Trainable parameters outside the blocks (LoRA on `lm_head`, or on Gemma 4's
`per_layer_model_projection` which feeds the per-layer inputs) are handled by
differentiating the head and `begin` too; the per-layer-input tensor is then a
third boundary stream whose cotangents are summed across segments.

Dropout: each segment's recompute restores the global PRNG key the segment's
forward started from, so it draws the same masks as the forward (and as the
full backward).

**Gradient checkpointing** (:func:`checkpointed_layers`): each block under
`mx.checkpoint` with its parameters, the donor K/V it reads and the K/V it
exports as explicit inputs/outputs (mlx-lm instead patches the block class's
`__call__` process-wide).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from .loss import head_loss, selected_rows, split_batch


# --- PRNG key save/restore (mx.random.seed((hi << 32) | lo) recreates a key) ---

def get_key() -> tuple[int, int]:
    hi, lo = (int(v) for v in mx.random.state[0].tolist())
    return hi, lo


def set_key(key: tuple[int, int]):
    mx.random.seed((key[0] << 32) | key[1])


# --- bookkeeping ---------------------------------------------------------------

def plan_segments(n_layers: int, segment_size: int) -> list[tuple[int, int]]:
    if segment_size < 1:
        raise ValueError("segment_size must be >= 1")
    return [(lo, min(lo + segment_size, n_layers)) for lo in range(0, n_layers, segment_size)]


def donors(model) -> tuple:
    d = getattr(model, "donor", None)
    return tuple(d) if d is not None else tuple(range(len(model.layers)))


def has_dropout(model) -> bool:
    import mlx.nn as nn
    return any(isinstance(m, nn.Dropout) and getattr(m, "_p_1", 1.0) < 1.0
               for _, m in model.named_modules())


def _layer_paths(model) -> list[str]:
    ids = {id(m): p for p, m in model.named_modules()}
    return [ids[id(l)] for l in model.layers]


def _bind(module, names, arrays):
    if names:
        module.update(tree_unflatten(list(zip(names, arrays))))


class _Params:
    """Trainable parameters split per block (relative names) and outside blocks."""

    def __init__(self, model):
        self.paths = _layer_paths(model)
        self.layer = []
        for l in model.layers:
            flat = tree_flatten(l.trainable_parameters())
            self.layer.append(([k for k, _ in flat], [v for _, v in flat]))
        prefixes = tuple(p + "." for p in self.paths)
        flat = tree_flatten(model.trainable_parameters())
        outer = [(k, v) for k, v in flat if not k.startswith(prefixes)]
        self.outer_names = [k for k, _ in outer]
        self.outer = [v for _, v in outer]

    def full_name(self, i, rel):
        return f"{self.paths[i]}.{rel}"


def _local_ctx(ctx, n, kv_in: dict, pli=None):
    c = dict(ctx)
    if "kv" in ctx:
        kv = [None] * n
        for d, (k, v, rest) in kv_in.items():
            kv[d] = (k, v, *rest)
        c["kv"] = kv
    if pli is not None:
        c["pli"] = pli
    return c


def _grad_tree(model, flat: dict):
    def pick(path, x):
        g = flat.get(path)
        return mx.zeros_like(x) if g is None else g
    return tree_map_with_path(pick, model.trainable_parameters())


# --- gradient checkpointing ----------------------------------------------------

def checkpointed_layers(model, h, ctx):
    """Run every block under mx.checkpoint (inside an outer value_and_grad)."""
    n = len(model.layers)
    donor = donors(model)
    exported = {donor[j] for j in range(n) if donor[j] != j}
    pli = ctx.get("pli")
    use_key = has_dropout(model)
    for i, layer in enumerate(model.layers):
        flat = tree_flatten(layer.trainable_parameters())
        names, arrays = [k for k, _ in flat], [v for _, v in flat]
        d = donor[i]
        ext, rest_d = [], ()
        if d != i:
            k, v, *rest = ctx["kv"][d]
            ext, rest_d = [k, v], tuple(rest)
        holder = {}

        def fn(h_, *rest_args, i=i, d=d, names=names, has_ext=bool(ext), layer=layer,
               rest_d=rest_d, holder=holder):
            if use_key:  # dropout: the recompute must draw the forward's masks
                if "key" in holder:
                    set_key(holder["key"])
                else:
                    holder["key"] = get_key()
            pos = 0
            kv_in = {}
            if has_ext:
                kv_in[d] = (rest_args[0], rest_args[1], tuple(rest_d))
                pos = 2
            pli_ = None
            if pli is not None:
                pli_ = rest_args[pos]
                pos += 1
            _bind(layer, names, rest_args[pos:])
            c = _local_ctx(ctx, n, kv_in, pli_)
            out = model.layer_step(i, h_, c)
            outs = [out]
            if i in exported:
                k_, v_, *r_ = c["kv"][i]
                holder["rest"] = tuple(r_)
                outs += [k_, v_]
            return outs

        args = [h] + ext + ([pli] if pli is not None else []) + arrays
        outs = mx.checkpoint(fn)(*args)
        h = outs[0]
        if i in exported:
            ctx["kv"][i] = (outs[1], outs[2], *holder["rest"])
    return h


# --- sub-block split (attention half / per-token MLP half) --------------------------

def split_block(layer):
    """(attn_half, mlp_half) that compose to `layer(x, mask, None)` op for op, for the
    Llama-layout blocks (llama, qwen3, minicpm); None for other blocks."""
    from engine.models import llama, minicpm
    if isinstance(layer, minicpm.Block):
        def attn(x, mask):
            return x + layer.self_attn(layer.input_layernorm(x), mask, None) * layer.branch_scale

        def mlp(h):
            return h + layer.mlp(layer.post_attention_layernorm(h)) * layer.branch_scale
        return attn, mlp
    if type(layer) is llama.Block:
        def attn(x, mask):
            return x + layer.self_attn(layer.input_layernorm(x), mask, None)

        def mlp(h):
            return h + layer.mlp(layer.post_attention_layernorm(h))
        return attn, mlp
    return None


def _chunks(T, n):
    return [(a, min(a + n, T)) for a in range(0, T, n)]


def _split_forward(split, x, mask, chunk):
    attn, mlp = split
    h = mx.stop_gradient(attn(x, mask))
    mx.eval(h)
    parts = []
    for a, b in _chunks(h.shape[1], chunk):
        y = mlp(h[:, a:b])
        mx.eval(y)
        parts.append(y)
    return mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _split_backward(model, P, i, split, x_in, dh, mask, chunk, h_primal, flat_grads):
    """Backward of block i in two vjps: the MLP half token chunk by token chunk,
    then the attention half. Returns the cotangent of the block input."""
    attn, mlp = split
    layer = model.layers[i]
    names, arrays = P.layer[i]
    mi = [k for k, nm in enumerate(names) if nm.startswith("mlp.")]
    ai = [k for k in range(len(names)) if k not in mi]
    m_names, m_arrays = [names[k] for k in mi], [arrays[k] for k in mi]
    a_names, a_arrays = [names[k] for k in ai], [arrays[k] for k in ai]
    h_mid = mx.stop_gradient(attn(x_in, mask))
    mx.eval(h_mid)

    def mlp_fn(hc, *ps):
        _bind(layer, m_names, ps)
        return [mlp(hc)]

    acc, d_mid = None, []
    for a, b in _chunks(h_mid.shape[1], chunk):
        _, g = mx.vjp(mlp_fn, [h_mid[:, a:b], *m_arrays], [dh[:, a:b]])
        d_mid.append(g[0])
        acc = list(g[1:]) if acc is None else [x + y for x, y in zip(acc, g[1:])]
        mx.eval(g[0], acc)
    d_mid = mx.concatenate(d_mid, axis=1) if len(d_mid) > 1 else d_mid[0]
    del h_mid

    def attn_fn(*args):
        x = args[0] if h_primal else x_in
        _bind(layer, a_names, args[1:] if h_primal else args)
        return [attn(x, mask)]

    prim = ([x_in] if h_primal else []) + a_arrays
    _, g = mx.vjp(attn_fn, prim, [d_mid])
    dx = g[0] if h_primal else None
    for nm, gr in zip(a_names, g[1:] if h_primal else g):
        flat_grads[P.full_name(i, nm)] = gr
    for nm, gr in zip(m_names, acc or []):
        flat_grads[P.full_name(i, nm)] = gr
    _bind(layer, names, arrays)
    mx.eval([x for x in [dx] if x is not None] + [flat_grads[P.full_name(i, nm)] for nm in names])
    return dx if h_primal else dh


# --- whole-layer token chunking (pre / core / post) ---------------------------------

def token_split(layer):
    """(pre, core, post) of a Llama-layout block (llama, qwen3, minicpm) that compose
    to `layer(x, mask, None)` op for op; None for other blocks.

    pre(x_rows, offset) -> (q, k, v): input norm, q/k/v projections (qwen3's q/k
    norms), RoPE at positions offset.. - a per-token function;
    core(q, k, v, mask) -> o [B, T, H*hd]: SDPA, the only op that mixes tokens;
    post(x_rows, o_rows) -> block output rows: o_proj, residual, post norm, MLP,
    residual - per token again."""
    from engine.models import llama, minicpm, qwen3
    if type(layer) not in (llama.Block, minicpm.Block):
        return None
    attn = layer.self_attn
    if type(attn) not in (llama.Attention, qwen3.Attention):
        return None
    qk_norm = isinstance(attn, qwen3.Attention)
    bs = layer.branch_scale if isinstance(layer, minicpm.Block) else None

    def pre(x, offset):
        B, L, _ = x.shape
        n = layer.input_layernorm(x)
        q = attn.q_proj(n).reshape(B, L, attn.n_heads, -1)
        k = attn.k_proj(n).reshape(B, L, attn.n_kv_heads, -1)
        if qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = attn.v_proj(n).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

    def core(q, k, v, mask):
        B, _, L, _ = q.shape
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask)
        return o.transpose(0, 2, 1, 3).reshape(B, L, -1)

    def post(x, o):
        a = attn.o_proj(o)
        h = x + (a * bs if bs is not None else a)
        m = layer.mlp(layer.post_attention_layernorm(h))
        return h + (m * bs if bs is not None else m)

    return pre, core, post


def _cat(parts, axis):
    return mx.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]


def _tok_qkv(pre, x, chunk):
    """q, k, v of the whole sequence, computed (no autograd) chunk by chunk."""
    qs, ks, vs = [], [], []
    for a, b in _chunks(x.shape[1], chunk):
        q, k, v = (mx.stop_gradient(t) for t in pre(x[:, a:b], a))
        mx.eval(q, k, v)
        qs.append(q), ks.append(k), vs.append(v)
    q, k, v = _cat(qs, 2), _cat(ks, 2), _cat(vs, 2)
    del qs, ks, vs
    mx.eval(q, k, v)
    return q, k, v


def _tok_forward(split, x, mask, chunk):
    pre, core, post = split
    q, k, v = _tok_qkv(pre, x, chunk)
    o = mx.stop_gradient(core(q, k, v, mask))
    mx.eval(o)
    del q, k, v
    parts = []
    for a, b in _chunks(x.shape[1], chunk):
        y = mx.stop_gradient(post(x[:, a:b], o[:, a:b]))
        mx.eval(y)
        parts.append(y)
    del o
    return _cat(parts, 1)


def _tok_backward(model, P, i, split, x_in, dh, mask, chunk, h_primal, flat_grads):
    """Backward of block i with every per-token part (norms, projections + LoRA,
    RoPE, MLP) differentiated `chunk` tokens at a time; only SDPA sees the whole
    sequence. Live at full length: q, k, v, o, their cotangents, dh / dx.
    Returns the cotangent of the block input (dh itself when not needed)."""
    pre, core, post = split
    layer = model.layers[i]
    names, arrays = P.layer[i]
    is_pre = [nm.startswith("input_layernorm.") or
              (nm.startswith("self_attn.") and not nm.startswith("self_attn.o_proj."))
              for nm in names]
    pre_n = [nm for nm, f in zip(names, is_pre) if f]
    pre_a = [ar for ar, f in zip(arrays, is_pre) if f]
    post_n = [nm for nm, f in zip(names, is_pre) if not f]
    post_a = [ar for ar, f in zip(arrays, is_pre) if not f]
    T = x_in.shape[1]
    spans = _chunks(T, chunk)

    def accumulate(acc, gs):
        return list(gs) if acc is None else [x + y for x, y in zip(acc, gs)]

    # recompute q, k, v and the attention output (no autograd)
    q, k, v = _tok_qkv(pre, x_in, chunk)
    o = mx.stop_gradient(core(q, k, v, mask))
    mx.eval(o)

    # post half (o_proj, MLP): per chunk -> d(o) rows, d(x) rows via the residual
    def post_fn(*args):
        if h_primal:
            xc, oc, ps = args[0], args[1], args[2:]
        else:
            xc, oc, ps = post_x[0], args[0], args[1:]
        _bind(layer, post_n, ps)
        return [post(xc, oc)]

    acc_post, do_parts, dxr_parts = None, [], []
    for a, b in spans:
        post_x = [x_in[:, a:b]]
        prim = ([x_in[:, a:b]] if h_primal else []) + [o[:, a:b]] + post_a
        _, g = mx.vjp(post_fn, prim, [dh[:, a:b]])
        if h_primal:
            dxr_parts.append(g[0])
            g = g[1:]
        do_parts.append(g[0])
        acc_post = accumulate(acc_post, g[1:])
        mx.eval(g[0], dxr_parts[-1:] if h_primal else [], acc_post)
    del o, g
    do = _cat(do_parts, 1)
    del do_parts
    dx_res = _cat(dxr_parts, 1) if h_primal else None
    del dxr_parts
    mx.eval(do, dx_res if h_primal else [])

    # core (SDPA) over the whole sequence
    _, (dq, dk, dv) = mx.vjp(lambda q_, k_, v_: [core(q_, k_, v_, mask)], [q, k, v], [do])
    mx.eval(dq, dk, dv)
    del q, k, v, do

    # pre half (norm, q/k/v projections, RoPE): per chunk -> d(x) rows
    def pre_fn(*args, offset=0):
        if h_primal:
            xc, ps = args[0], args[1:]
        else:
            xc, ps = pre_x[0], args
        _bind(layer, pre_n, ps)
        return list(pre(xc, offset))

    acc_pre, dx_parts = None, []
    for a, b in spans:
        pre_x = [x_in[:, a:b]]
        prim = ([x_in[:, a:b]] if h_primal else []) + pre_a
        _, g = mx.vjp(lambda *args, a=a: pre_fn(*args, offset=a), prim,
                      [dq[:, :, a:b], dk[:, :, a:b], dv[:, :, a:b]])
        if h_primal:
            dx_parts.append(dx_res[:, a:b] + g[0])
            g = g[1:]
        acc_pre = accumulate(acc_pre, g)
        mx.eval(dx_parts[-1:] if h_primal else [], acc_pre)
    del dq, dk, dv, dx_res
    _bind(layer, names, arrays)
    for nm, gr in zip(pre_n, acc_pre or []):
        flat_grads[P.full_name(i, nm)] = gr
    for nm, gr in zip(post_n, acc_post or []):
        flat_grads[P.full_name(i, nm)] = gr
    if not h_primal:
        return dh
    dx = _cat(dx_parts, 1)
    del dx_parts
    mx.eval(dx)
    return dx


# --- loss head, chunk by chunk -------------------------------------------------------

def _chunked_head_vjp(model, P, h, targets, mask, chunk_size, sel, key):
    """(loss, dh, outer grads) of the ``chunked`` loss head, one `chunk_size`-row
    chunk of the counted rows at a time: each chunk's forward and vjp run and are
    evaluated before the next, so only one chunk's [chunk, vocab] logits and its
    [chunk, hidden] cotangent are live, and dh is assembled once (one scatter into
    [B*T, hidden]). Differentiating `gathered_head_loss` as one graph instead
    leaves the backward free to materialise every chunk's cotangent as a full-size
    [rows, hidden] slice update before summing them - ~7 GB at 1B / 32K on the
    H200. The loss is computed with gathered_head_loss's ops (bit-exact); the
    cotangent of each row's CE does not depend on the CE values, so it is taken
    up front from the reduction alone."""
    from .loss import _reduce, _rows_ce
    B, T, D = h.shape
    M = int(sel.shape[0])
    h_sel = h.reshape(B * T, D)[sel]
    t_sel = targets.reshape(B * T)[sel]
    step = chunk_size if chunk_size and M > chunk_size else M
    set_key(key)
    ce_dtype = _rows_ce(model, h_sel[:1], t_sel[:1]).dtype  # lazy, never evaluated
    set_key(key)  # the probe may have drawn dropout masks

    def reduce(ce_sel):
        ce = mx.zeros((B * T,), dtype=ce_sel.dtype).at[sel].add(ce_sel).reshape(B, T)
        return [_reduce(ce, mask)[0]]

    _, (d_ce,) = mx.vjp(reduce, [mx.zeros((M,), dtype=ce_dtype)],
                        [mx.array(1.0, dtype=mx.float32)])

    def fn(hr, *ps, tr):
        _bind(model, P.outer_names, ps)
        return [_rows_ce(model, hr, tr)]

    ces, dhs, acc = [], [], None
    for a in range(0, M, step):
        b = min(a + step, M)
        (ce_c,), g = mx.vjp(lambda hr, *ps, tr=t_sel[a:b]: fn(hr, *ps, tr=tr),
                            [h_sel[a:b], *P.outer], [d_ce[a:b]])
        acc = list(g[1:]) if acc is None else [x + y for x, y in zip(acc, g[1:])]
        ces.append(ce_c)
        dhs.append(g[0])
        mx.eval(ce_c, g[0], acc)
    _bind(model, P.outer_names, P.outer)
    del h_sel, g
    loss = reduce(_cat(ces, 0))[0]
    dh_sel = _cat(dhs, 0)
    del dhs
    dh = mx.zeros((B * T, D), dtype=h.dtype).at[sel].add(dh_sel).reshape(B, T, D)
    return loss, dh, acc


# --- segmented backward ---------------------------------------------------------

def segmented_value_and_grad(model, batch, lengths, segment_size: int,
                             head: str = "chunked", chunk_size: int = 1024,
                             return_stats: bool = False, exact_kv_order: bool = True,
                             mlp_chunk: int = 0, token_chunk: int = 0):
    """((loss, ntoks), grads) like `nn.value_and_grad(model, sft_loss)`, computed
    segment by segment (see the module docstring). `grads` has the structure of
    `model.trainable_parameters()`.

    exact_kv_order: give every KV-sharing layer its own donor K/V primal so that
    the donor's cotangent is summed one sharer at a time, last sharer first - the
    order the full backward adds them in, which makes every segment cut bit-exact.
    False pre-sums the sharers of one segment inside its vjp (the straightforward
    design; it re-associates the sum whenever a segment holds several sharers of
    an earlier donor).

    mlp_chunk > 0 (segment_size 1, no dropout, Llama-layout blocks): each block is
    split at the attention/MLP boundary and the MLP half - a per-token function -
    is run forward and differentiated `mlp_chunk` tokens at a time, so its
    [T, intermediate] activations (and LoRA's float32 [T, out] terms) are never
    live for the whole sequence. Hidden-state cotangents stay exact (rows are
    independent); the MLP LoRA gradients become a sum over token chunks, which
    re-associates their reduction (measured in tests/train/test_segmented.py).

    token_chunk > 0 (segment_size 1, no dropout, Llama-layout blocks; supersedes
    mlp_chunk): the whole block is split into its per-token parts - input norm,
    q/k/v projections and RoPE before SDPA, o_proj and the MLP after it - and only
    SDPA sees the whole sequence; forward and backward run every per-token part
    `token_chunk` tokens at a time (see :func:`token_split`), so no [T, hidden]
    or [T, intermediate] activation of a projection, its LoRA float32 terms or
    its cotangent is live beyond one chunk. Blocks of other layouts fall back to
    the plain segment vjp. Hidden-state cotangents are exact per row; every LoRA
    gradient becomes a sum over chunks (re-associated; measured in
    tests/train/test_segmented.py)."""
    inputs, targets, mask = split_batch(batch, lengths)
    n = len(model.layers)
    segs = plan_segments(n, segment_size)
    donor = donors(model)
    P = _Params(model)
    need_outer = bool(P.outer)
    sel = None if head == "full" else selected_rows(mask)
    splits = tsplits = None
    if token_chunk:
        if segment_size != 1:
            raise ValueError("token_chunk needs segment_size 1")
        if has_dropout(model):
            raise ValueError("token_chunk does not support LoRA dropout")
        tsplits = [token_split(l) for l in model.layers]
    elif mlp_chunk:
        if segment_size != 1:
            raise ValueError("mlp_chunk needs segment_size 1")
        if has_dropout(model):
            raise ValueError("mlp_chunk does not support LoRA dropout")
        splits = [split_block(l) for l in model.layers]

    seg_of = {i: s for s, (lo, hi) in enumerate(segs) for i in range(lo, hi)}
    ext_donors, exported = [], []
    for s, (lo, hi) in enumerate(segs):
        # (sharer layer, donor) pairs whose donor sits in an earlier segment
        ext_donors.append([(i, donor[i]) for i in range(lo, hi) if donor[i] != i and donor[i] < lo])
        exported.append(sorted({d for d in range(lo, hi)
                                if any(donor[j] == d and seg_of[j] > s for j in range(hi, n))}))

    # ---- forward: detached boundaries only
    begin_key = get_key()
    h, ctx = model.begin(inputs)
    pli = ctx.get("pli")
    need_pli = need_outer and pli is not None
    h = mx.stop_gradient(h)
    const = [h] + [m for m in ctx.get("masks", []) if isinstance(m, mx.array)]
    if pli is not None:
        pli = mx.stop_gradient(pli)
        ctx["pli"] = pli
        const.append(pli)
    mx.eval(const)
    bounds = [h]
    kv_bound: dict[int, tuple] = {}
    keys = []
    for s, (lo, hi) in enumerate(segs):
        keys.append(get_key())
        for i in range(lo, hi):
            if tsplits is not None and tsplits[i] is not None:
                h = _tok_forward(tsplits[i], h, ctx["masks"][i], token_chunk)
            elif splits is not None and splits[i] is not None:
                h = _split_forward(splits[i], h, ctx["masks"][i], mlp_chunk)
            else:
                h = model.layer_step(i, h, ctx)
        h = mx.stop_gradient(h)
        to_eval = [h]
        if "kv" in ctx:
            for d in exported[s]:
                k, v, *rest = ctx["kv"][d]
                k, v = mx.stop_gradient(k), mx.stop_gradient(v)
                kv_bound[d] = (k, v, tuple(rest))
                ctx["kv"][d] = (k, v, *rest)
                to_eval += [k, v]
            for i in range(lo, hi):
                if i not in exported[s]:
                    ctx["kv"][i] = None
        mx.eval(to_eval)
        bounds.append(h)
    end_key = get_key()
    fwd_peak = mx.get_peak_memory() if return_stats else None

    flat_grads: dict[str, mx.array] = {}

    def add_outer(gs):
        for name, g in zip(P.outer_names, gs):
            flat_grads[name] = g if name not in flat_grads else flat_grads[name] + g

    # ---- loss head
    def head_fn(h_last, *outer):
        _bind(model, P.outer_names, outer)
        set_key(end_key)
        loss, _ = head_loss(model, h_last, targets, mask, head, chunk_size, sel)
        return [loss]

    if head == "chunked" and int(sel.shape[0]) > 0:
        loss, dh, g_outer = _chunked_head_vjp(model, P, bounds[-1], targets, mask, chunk_size,
                                              sel, end_key)
    else:
        (loss,), g = mx.vjp(head_fn, [bounds[-1], *P.outer], [mx.array(1.0, dtype=mx.float32)])
        dh, g_outer = g[0], g[1:]
    add_outer(g_outer)
    _bind(model, P.outer_names, P.outer)
    ntoks = mask.sum()
    mx.eval(loss, ntoks, dh, *[flat_grads[k] for k in P.outer_names if k in flat_grads])
    head_peak = mx.get_peak_memory() if return_stats else None
    del bounds[-1]

    # ---- backward, last segment first
    kv_cot: dict[int, list] = {}
    pli_cot = None
    for s in reversed(range(len(segs))):
        lo, hi = segs[s]
        h_in = bounds[s]
        h_primal = s > 0 or need_outer
        if tsplits is not None and tsplits[lo] is not None:
            dh = _tok_backward(model, P, lo, tsplits[lo], h_in, dh, ctx["masks"][lo],
                               token_chunk, h_primal, flat_grads)
            del bounds[s], h_in
            continue
        if splits is not None and splits[lo] is not None:
            dh = _split_backward(model, P, lo, splits[lo], h_in, dh, ctx["masks"][lo],
                                 mlp_chunk, h_primal, flat_grads)
            del bounds[s]
            continue
        if exact_kv_order:
            ext = [(j, d, (j,)) for j, d in ext_donors[s]]
        else:  # one primal per donor: its sharers' cotangents are pre-summed in the vjp
            by_d: dict[int, list] = {}
            for j, d in ext_donors[s]:
                by_d.setdefault(d, []).append(j)
            ext = [(max(js), d, tuple(js)) for d, js in sorted(by_d.items())]
        exp = exported[s]
        names = [nm for i in range(lo, hi) for nm in P.layer[i][0]]
        owners = [i for i in range(lo, hi) for _ in P.layer[i][0]]
        arrays = [a for i in range(lo, hi) for a in P.layer[i][1]]

        primals = ([h_in] if h_primal else [])
        for j, d, _ in ext:
            # one distinct primal per sharer (stop_gradient: a new array sharing the
            # buffer), so each sharer's cotangent comes back on its own and is added
            # to the accumulator in the full backward's order (last sharer first)
            primals += [mx.stop_gradient(kv_bound[d][0]), mx.stop_gradient(kv_bound[d][1])]
        if need_pli:
            primals.append(pli)
        n_lead = len(primals)
        primals += arrays

        def seg_fn(*args, lo=lo, hi=hi, s=s, ext=ext, exp=exp, h_primal=h_primal,
                   n_lead=n_lead):
            pos = 0
            if h_primal:
                x = args[0]
                pos = 1
            else:
                x = h_in
            kv_of = {}
            for j, d, sharers in ext:
                for jj in sharers:
                    kv_of[jj] = (d, (args[pos], args[pos + 1], kv_bound[d][2]))
                pos += 2
            pli_ = None
            if need_pli:
                pli_ = args[pos]
                pos += 1
            for i in range(lo, hi):
                nm = P.layer[i][0]
                _bind(model.layers[i], nm, args[pos:pos + len(nm)])
                pos += len(nm)
            set_key(keys[s])
            c = _local_ctx(ctx, n, {}, pli_ if pli_ is not None else ctx.get("pli"))
            for i in range(lo, hi):
                if i in kv_of:
                    d, (k_, v_, rest) = kv_of[i]
                    c["kv"][d] = (k_, v_, *rest)
                x = model.layer_step(i, x, c)
            outs = [x]
            for d in exp:
                outs += [c["kv"][d][0], c["kv"][d][1]]
            return outs

        cots = [dh]
        for d in exp:
            if d not in kv_cot:
                raise RuntimeError(f"donor {d}: no cotangent from its sharers (segment plan bug)")
            cots += kv_cot.pop(d)
        _, g = mx.vjp(seg_fn, primals, cots)
        pos = 0
        if h_primal:
            dh = g[0]
            pos = 1
        per_sharer = []
        for j, d, _ in ext:
            per_sharer.append((j, d, g[pos], g[pos + 1]))
            pos += 2
        for j, d, dk, dv in sorted(per_sharer, key=lambda t: -t[0]):
            if d in kv_cot:
                kv_cot[d] = [kv_cot[d][0] + dk, kv_cot[d][1] + dv]
            else:
                kv_cot[d] = [dk, dv]
        if need_pli:
            pli_cot = g[pos] if pli_cot is None else pli_cot + g[pos]
            pos += 1
        for i, nm, gr in zip(owners, names, g[pos:]):
            flat_grads[P.full_name(i, nm)] = gr
        for i in range(lo, hi):
            _bind(model.layers[i], *P.layer[i])
        to_eval = [flat_grads[P.full_name(i, nm)] for i, nm in zip(owners, names)]
        to_eval += [x for pair in kv_cot.values() for x in pair]
        if h_primal:
            to_eval.append(dh)
        if pli_cot is not None:
            to_eval.append(pli_cot)
        mx.eval(to_eval)
        del bounds[s]

    # ---- begin (only when something upstream of the blocks is trainable)
    if need_outer:
        def begin_fn(*outer):
            _bind(model, P.outer_names, outer)
            set_key(begin_key)
            h0, c = model.begin(inputs)
            return [h0] + ([c["pli"]] if need_pli else [])
        cots = [dh] + ([pli_cot] if need_pli else [])
        _, g = mx.vjp(begin_fn, list(P.outer), cots)
        add_outer(g)
        _bind(model, P.outer_names, P.outer)
        mx.eval([flat_grads[k] for k in P.outer_names])

    set_key(end_key)
    grads = _grad_tree(model, flat_grads)
    if return_stats:
        return (loss, ntoks), grads, {"forward_peak": fwd_peak, "head_peak": head_peak,
                                      "segments": segs}
    return (loss, ntoks), grads
