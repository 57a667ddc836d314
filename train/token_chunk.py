"""Token-chunked blocks for the segmented backward (train/segmented.py, segment size 1).

A block that returns a split (`token_split()` / `half_split()`, see
engine/models/split.py) is run forward and differentiated with its per-token
parts - norms, projections with their LoRA terms, RoPE, the MLP - `chunk`
tokens at a time, so that no [T, hidden] or [T, intermediate] activation of a
projection, its LoRA float32 terms or its cotangent is live beyond one chunk.
Only attention sees the whole sequence; beyond a length threshold it runs in
query blocks as well (train/attention.py), so no op sees the whole T x T
product either.

KV-shared layers (Gemma 4) attend over their donor's K/V: a sharer's dk / dv
are added to the donor's cotangent accumulator (`kv_cot`, shared with the plain
segment path), and a donor adds what its sharers accumulated to its own dk / dv
before differentiating its projections.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_unflatten

from .attention import Blocking, blocked_attention, blocked_attention_vjp


def bind(module, names, arrays):
    if names:
        module.update(tree_unflatten(list(zip(names, arrays))))


def chunks(T, n):
    return [(a, min(a + n, T)) for a in range(0, T, n)]


def cat(parts, axis):
    return mx.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]


def token_split_of(model, i):
    """Layer i's TokenSplit, or None (the layer runs the plain segment vjp)."""
    fn = getattr(model, "token_split", None)
    if fn is not None:
        return fn(i)
    fn = getattr(model.layers[i], "token_split", None)
    return fn() if fn is not None else None


def half_split_of(model, i):
    fn = getattr(model.layers[i], "half_split", None)
    return fn() if fn is not None else None


def _accumulate(acc, gs):
    return list(gs) if acc is None else [x + y for x, y in zip(acc, gs)]


# --- MLP half in token chunks (mlp_chunk) -------------------------------------------

def half_forward(split, x, mask, chunk):
    h = mx.stop_gradient(split.attn(x, mask))
    mx.eval(h)
    parts = []
    for a, b in chunks(h.shape[1], chunk):
        y = split.mlp(h[:, a:b])
        mx.eval(y)
        parts.append(y)
    return cat(parts, 1)


def half_backward(layer, names, arrays, split, x_in, dh, mask, chunk, h_primal):
    """Backward of a block in two vjps: the MLP half token chunk by token chunk,
    then the attention half. Returns (dx or dh, {relative name: grad})."""
    mi = [k for k, nm in enumerate(names) if nm.startswith("mlp.")]
    ai = [k for k in range(len(names)) if k not in mi]
    m_names, m_arrays = [names[k] for k in mi], [arrays[k] for k in mi]
    a_names, a_arrays = [names[k] for k in ai], [arrays[k] for k in ai]
    h_mid = mx.stop_gradient(split.attn(x_in, mask))
    mx.eval(h_mid)

    def mlp_fn(hc, *ps):
        bind(layer, m_names, ps)
        return [split.mlp(hc)]

    acc, d_mid = None, []
    for a, b in chunks(h_mid.shape[1], chunk):
        _, g = mx.vjp(mlp_fn, [h_mid[:, a:b], *m_arrays], [dh[:, a:b]])
        d_mid.append(g[0])
        acc = _accumulate(acc, g[1:])
        mx.eval(g[0], acc)
    d_mid = cat(d_mid, 1)
    del h_mid

    def attn_fn(*args):
        x = args[0] if h_primal else x_in
        bind(layer, a_names, args[1:] if h_primal else args)
        return [split.attn(x, mask)]

    _, g = mx.vjp(attn_fn, ([x_in] if h_primal else []) + a_arrays, [d_mid])
    dx = g[0] if h_primal else dh
    grads = dict(zip(a_names, g[1:] if h_primal else g))
    grads.update(zip(m_names, acc or []))
    bind(layer, names, arrays)
    mx.eval(dx, list(grads.values()))
    return dx, grads


# --- whole block in token chunks (token_chunk) ---------------------------------------

class TokenBlock:
    """One layer's token-chunked forward and backward.

    ctx: the model's forward context (masks, per-layer inputs `pli`, the K/V of
    donor layers `kv`); blocking: how attention is cut (train/attention.py)."""

    def __init__(self, model, i, split, ctx, chunk: int, blocking: Blocking):
        self.model, self.i, self.split, self.ctx = model, i, split, ctx
        self.chunk = chunk
        self.blocking = Blocking(blocking.block, split.window)  # the layer's own window
        self.layer = model.layers[i]
        donor = getattr(model, "donor", None)
        self.donor = donor[i] if donor is not None else i

    # attention over the whole sequence (blocked beyond the threshold)
    def _blocked(self, T):
        return self.blocking.block and T > self.blocking.block

    def core(self, q, k, v):
        B, _, T, _ = q.shape
        if self._blocked(T):
            o = blocked_attention(q, k, v, self.split.scale, self.blocking)
        else:
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.split.scale,
                                                     mask=self.ctx["masks"][self.i])
        return o.transpose(0, 2, 1, 3).reshape(B, T, -1)

    def core_vjp(self, q, k, v, do):
        B, T, _ = do.shape
        do = do.reshape(B, T, q.shape[1], -1).transpose(0, 2, 1, 3)
        if self._blocked(T):
            return blocked_attention_vjp(q, k, v, self.split.scale, self.blocking, do)
        mask = self.ctx["masks"][self.i]
        _, g = mx.vjp(lambda q_, k_, v_: [mx.fast.scaled_dot_product_attention(
            q_, k_, v_, scale=self.split.scale, mask=mask)], [q, k, v], [do])
        return tuple(g)

    def _pli(self, a, b):
        pli = self.ctx.get("pli")
        return None if pli is None else pli[:, a:b, self.i, :]

    def qkv(self, x):
        """q, k, v of the whole sequence, computed (no autograd) chunk by chunk;
        a KV-shared layer takes k, v from its donor's entry in ctx["kv"]."""
        parts = []
        for a, b in chunks(x.shape[1], self.chunk):
            out = tuple(mx.stop_gradient(t) for t in self.split.pre(x[:, a:b], a))
            mx.eval(out)
            parts.append(out)
        res = [cat([p[j] for p in parts], 2) for j in range(len(parts[0]))]
        del parts
        if self.split.shared:
            k, v = self.ctx["kv"][self.donor][:2]
            res += [k, v]
        mx.eval(res)
        return res

    def forward(self, x):
        q, k, v = self.qkv(x)
        if "kv" in self.ctx and not self.split.shared:
            self.ctx["kv"][self.i] = (k, v, 0, None)  # (keys, values, offset, cache)
        o = mx.stop_gradient(self.core(q, k, v))
        mx.eval(o)
        del q, k, v
        parts = []
        for a, b in chunks(x.shape[1], self.chunk):
            y = mx.stop_gradient(self.split.post(x[:, a:b], o[:, a:b], self._pli(a, b)))
            mx.eval(y)
            parts.append(y)
        del o
        return cat(parts, 1)

    def backward(self, names, arrays, x_in, dh, h_primal: bool, kv_cot: Optional[dict] = None):
        """(dx or dh, {relative name: grad}). kv_cot: donor -> [dk, dv] accumulators."""
        split, layer = self.split, self.layer
        is_pre = [split.is_pre(nm) for nm in names]
        pre_n = [nm for nm, f in zip(names, is_pre) if f]
        pre_a = [ar for ar, f in zip(arrays, is_pre) if f]
        post_n = [nm for nm, f in zip(names, is_pre) if not f]
        post_a = [ar for ar, f in zip(arrays, is_pre) if not f]
        spans = chunks(x_in.shape[1], self.chunk)

        q, k, v = self.qkv(x_in)
        o = mx.stop_gradient(self.core(q, k, v))
        mx.eval(o)

        # post half (o_proj, MLP, per-layer input): per chunk -> d(o), d(x) rows
        def post_fn(*args, a=0, b=0):
            xc, args = (args[0], args[1:]) if h_primal else (x_in[:, a:b], args)
            bind(layer, post_n, args[1:])
            return [split.post(xc, args[0], self._pli(a, b))]

        acc_post, do_parts, dxr_parts = None, [], []
        for a, b in spans:
            prim = ([x_in[:, a:b]] if h_primal else []) + [o[:, a:b]] + post_a
            _, g = mx.vjp(lambda *args, a=a, b=b: post_fn(*args, a=a, b=b), prim, [dh[:, a:b]])
            if h_primal:
                dxr_parts.append(g[0])
                g = g[1:]
            do_parts.append(g[0])
            acc_post = _accumulate(acc_post, g[1:])
            mx.eval(g[0], dxr_parts[-1:], acc_post)
        del o, g
        do = cat(do_parts, 1)
        del do_parts
        dx_res = cat(dxr_parts, 1) if h_primal else None
        del dxr_parts
        mx.eval(do, dx_res if h_primal else [])

        dq, dk, dv = self.core_vjp(q, k, v, do)
        mx.eval(dq, dk, dv)
        del q, k, v, do
        if split.shared:  # the donor's projections get these when its turn comes
            if self.donor in kv_cot:
                kv_cot[self.donor] = [kv_cot[self.donor][0] + dk, kv_cot[self.donor][1] + dv]
            else:
                kv_cot[self.donor] = [dk, dv]
            mx.eval(kv_cot[self.donor])
            cots = [dq]
        else:
            if kv_cot is not None and self.i in kv_cot:
                sk, sv = kv_cot.pop(self.i)
                dk, dv = dk + sk, dv + sv
            cots = [dq, dk, dv]
        del dq, dk, dv

        # pre half (norm, projections, RoPE): per chunk -> d(x) rows
        def pre_fn(*args, a=0, b=0):
            xc, ps = (args[0], args[1:]) if h_primal else (x_in[:, a:b], args)
            bind(layer, pre_n, ps)
            return list(split.pre(xc, a))

        acc_pre, dx_parts = None, []
        for a, b in spans:
            prim = ([x_in[:, a:b]] if h_primal else []) + pre_a
            _, g = mx.vjp(lambda *args, a=a, b=b: pre_fn(*args, a=a, b=b), prim,
                          [c[:, :, a:b] for c in cots])
            if h_primal:
                dx_parts.append(dx_res[:, a:b] + g[0])
                g = g[1:]
            acc_pre = _accumulate(acc_pre, g)
            mx.eval(dx_parts[-1:], acc_pre)
        del cots, dx_res
        bind(layer, names, arrays)
        grads = dict(zip(pre_n, acc_pre or []))
        grads.update(zip(post_n, acc_post or []))
        if not h_primal:
            return dh, grads
        dx = cat(dx_parts, 1)
        del dx_parts
        mx.eval(dx)
        return dx, grads
