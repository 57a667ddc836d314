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

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from .attention import Blocking
from .loss import chunked_head_vjp, head_loss, selected_rows, split_batch
from .token_chunk import (TokenBlock, bind, half_backward, half_forward, half_split_of,
                          token_split_of)


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
            bind(layer, names, rest_args[pos:])
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


# Automatic attention blocking: beyond AUTO_ATTN_ABOVE tokens (the whole-sequence fused
# CUDA vjp fails from 131072 tokens at 1B, 65536 at 8B: train/attention.py), query
# blocks of AUTO_ATTN_BLOCK rows, each cut into head groups under the fused op's limit.
AUTO_ATTN_BLOCK, AUTO_ATTN_ABOVE = 8192, 32768


def resolve_attn_block(attn_block: int, T: int) -> int:
    """Query rows per attention block for a T-token sequence (0: one block)."""
    if attn_block < 0:
        return 0
    if attn_block == 0:
        return AUTO_ATTN_BLOCK if T > AUTO_ATTN_ABOVE else 0
    return attn_block if T > attn_block else 0


# --- segmented backward ---------------------------------------------------------

def segmented_value_and_grad(model, batch, lengths, segment_size: int,
                             head: str = "chunked", chunk_size: int = 1024,
                             return_stats: bool = False, exact_kv_order: bool = True,
                             mlp_chunk: int = 0, token_chunk: int = 0, attn_block: int = 0):
    """((loss, ntoks), grads) like `nn.value_and_grad(model, sft_loss)`, computed
    segment by segment (see the module docstring). `grads` has the structure of
    `model.trainable_parameters()`.

    exact_kv_order: give every KV-sharing layer its own donor K/V primal so that
    the donor's cotangent is summed one sharer at a time, last sharer first - the
    order the full backward adds them in, which makes every segment cut bit-exact.
    False pre-sums the sharers of one segment inside its vjp (the straightforward
    design; it re-associates the sum whenever a segment holds several sharers of
    an earlier donor).

    mlp_chunk > 0 (segment_size 1, no dropout, blocks with `half_split()`): each block is
    split at the attention/MLP boundary and the MLP half - a per-token function -
    is run forward and differentiated `mlp_chunk` tokens at a time, so its
    [T, intermediate] activations (and LoRA's float32 [T, out] terms) are never
    live for the whole sequence. Hidden-state cotangents stay exact (rows are
    independent); the MLP LoRA gradients become a sum over token chunks, which
    re-associates their reduction (measured in tests/train/test_segmented.py).

    token_chunk > 0 (segment_size 1, no dropout, blocks with a token split -
    Llama layout and Gemma 4, see engine/models/split.py; supersedes mlp_chunk):
    the whole block is split into its per-token parts - input norm,
    q/k/v projections and RoPE before SDPA, o_proj and the MLP after it - and only
    SDPA sees the whole sequence; forward and backward run every per-token part
    `token_chunk` tokens at a time (see train/token_chunk.py), so no [T, hidden]
    or [T, intermediate] activation of a projection, its LoRA float32 terms or
    its cotangent is live beyond one chunk. Blocks of other layouts fall back to
    the plain segment vjp. Hidden-state cotangents are exact per row; every LoRA
    gradient becomes a sum over chunks (re-associated; measured in
    tests/train/test_segmented.py). With per-layer inputs upstream of trainable
    parameters (LoRA on Gemma 4's per_layer_model_projection) every block runs
    the plain segment vjp.

    attn_block (with token_chunk): attention's forward and backward in query
    blocks of that many rows (train/attention.py) when the sequence is longer
    than one block; 0 = automatic (see resolve_attn_block: beyond
    AUTO_ATTN_ABOVE tokens, where MLX's whole-sequence fused backward fails on
    CUDA; below it the whole-sequence op runs, as before); -1 = never."""
    inputs, targets, mask = split_batch(batch, lengths)
    n = len(model.layers)
    segs = plan_segments(n, segment_size)
    donor = donors(model)
    P = _Params(model)
    need_outer = bool(P.outer)
    sel = None if head == "full" else selected_rows(mask)
    splits = tsplits = None
    blocking = Blocking(resolve_attn_block(attn_block, inputs.shape[1]))
    if token_chunk:
        if segment_size != 1:
            raise ValueError("token_chunk needs segment_size 1")
        if has_dropout(model):
            raise ValueError("token_chunk does not support LoRA dropout")
        tsplits = [token_split_of(model, i) for i in range(n)]
    elif mlp_chunk:
        if segment_size != 1:
            raise ValueError("mlp_chunk needs segment_size 1")
        if has_dropout(model):
            raise ValueError("mlp_chunk does not support LoRA dropout")
        splits = [half_split_of(model, i) for i in range(n)]

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
    if need_pli and tsplits is not None:  # per-layer-input cotangents: plain segment path
        tsplits = None
    tblocks = [None] * n
    if tsplits is not None:
        tblocks = [TokenBlock(model, i, sp, ctx, token_chunk, blocking) if sp is not None else None
                   for i, sp in enumerate(tsplits)]
    T = inputs.shape[1]
    blocked = tsplits is not None and blocking.block and T > blocking.block
    # attention masks are evaluated once here, unless blocked attention builds its own
    # per block (a [T, T] sliding-window mask at long contexts is the size of the problem)
    const = [h] + ([] if blocked else
                   [m for m in ctx.get("masks", []) if isinstance(m, mx.array)])
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
            if tblocks[i] is not None:
                h = tblocks[i].forward(h)
            elif splits is not None and splits[i] is not None:
                h = half_forward(splits[i], h, ctx["masks"][i], mlp_chunk)
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
        bind(model, P.outer_names, outer)
        set_key(end_key)
        loss, _ = head_loss(model, h_last, targets, mask, head, chunk_size, sel)
        return [loss]

    if head == "chunked" and int(sel.shape[0]) > 0:
        loss, dh, g_outer = chunked_head_vjp(model, P.outer_names, P.outer, bounds[-1], targets,
                                             mask, chunk_size, sel, end_key)
    else:
        (loss,), g = mx.vjp(head_fn, [bounds[-1], *P.outer], [mx.array(1.0, dtype=mx.float32)])
        dh, g_outer = g[0], g[1:]
    add_outer(g_outer)
    bind(model, P.outer_names, P.outer)
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
        if tblocks[lo] is not None or (splits is not None and splits[lo] is not None):
            names, arrays = P.layer[lo]
            if tblocks[lo] is not None:
                dh, g = tblocks[lo].backward(names, arrays, h_in, dh, h_primal, kv_cot)
            else:
                dh, g = half_backward(model.layers[lo], names, arrays, splits[lo], h_in, dh,
                                      ctx["masks"][lo], mlp_chunk, h_primal)
            for nm, gr in g.items():
                flat_grads[P.full_name(lo, nm)] = gr
            if lo in kv_bound:  # a donor: no earlier layer reads its K/V
                kv_bound.pop(lo)
                ctx["kv"][lo] = None
            del bounds[s], h_in
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
                bind(model.layers[i], nm, args[pos:pos + len(nm)])
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
            bind(model.layers[i], *P.layer[i])
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
            bind(model, P.outer_names, outer)
            set_key(begin_key)
            h0, c = model.begin(inputs)
            return [h0] + ([c["pli"]] if need_pli else [])
        cots = [dh] + ([pli_cot] if need_pli else [])
        _, g = mx.vjp(begin_fn, list(P.outer), cots)
        add_outer(g)
        bind(model, P.outer_names, P.outer)
        mx.eval([flat_grads[k] for k in P.outer_names])

    set_key(end_key)
    grads = _grad_tree(model, flat_grads)
    if return_stats:
        return (loss, ntoks), grads, {"forward_peak": fwd_peak, "head_peak": head_peak,
                                      "segments": segs}
    return (loss, ntoks), grads
