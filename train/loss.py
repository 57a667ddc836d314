"""SFT loss, equal to mlx-lm's `tuner.trainer.default_loss` bit for bit.

A batch is `[B, T+1]` token ids (right-padded with id 0) and `lengths` `[B, 2]`
= (prompt offset, length). Inputs are `batch[:, :-1]`, targets `batch[:, 1:]`;
target column t (predicting token t+1) counts when

    offset <= t + 1 <= length

i.e. the response tokens *and one padding target per row* (the `<=`: column
`length - 1` predicts `batch[length]`, which is the pad id 0 unless the row was
truncated to the full width). That quirk is mlx-lm's (ml-explore/mlx-lm#1697);
we reproduce it so losses and gradients match. The loss is the token-weighted
mean over the whole batch: sum(CE * mask) in float32 / mask.sum().

Loss heads (what turns the last hidden state into the loss):

- ``full``: `model.head(h)` on every position ([B, T, vocab] logits), exactly
  default_loss's graph.
- ``gather``: the head only on the counted positions (rows selected on the
  host from `lengths`), CE scattered back into a [B, T] zero array and reduced
  exactly as ``full`` reduces it - the same values in the same reduction, so it
  is bit-exact with ``full`` wherever the head's matmul is row-independent
  (MLX's CPU backend; see docs/training.md).
- ``chunked``: ``gather`` in chunks of `chunk_size` rows, each chunk under
  `mx.checkpoint`, so at most one chunk's [chunk, vocab] logits is live in the
  forward and the backward.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

HEADS = ("full", "gather", "chunked")


def loss_mask(lengths: mx.array, n_targets: int) -> mx.array:
    """Boolean [B, n_targets]: which target columns count (see module docstring)."""
    col = mx.arange(1, n_targets + 1)
    return mx.logical_and(col >= lengths[:, 0:1], col <= lengths[:, 1:])


def _reduce(ce: mx.array, mask: mx.array):
    """Token-weighted mean of the masked CE, as mlx-lm reduces it."""
    ntoks = mask.sum()
    return (ce * mask).astype(mx.float32).sum() / ntoks, ntoks


def full_head_loss(model, h, targets, mask):
    logits = model.head(h)
    return _reduce(nn.losses.cross_entropy(logits, targets), mask)


def selected_rows(mask: mx.array) -> mx.array:
    """Flat indices of the counted target columns (a host read of a [B, T] bool)."""
    return mx.array(np.flatnonzero(np.array(mask).reshape(-1)).astype(np.int32))


def _outer_trainable(model):
    ids = {id(l) for l in model.layers}
    prefixes = tuple(p + "." for p, m in model.named_modules() if id(m) in ids)
    flat = [(k, v) for k, v in tree_flatten(model.trainable_parameters())
            if not k.startswith(prefixes)]
    return [k for k, _ in flat], [v for _, v in flat]


def _replay_key(holder, use_key):
    """Under dropout, make a checkpoint's recompute draw the masks its forward drew."""
    if not use_key:
        return
    from .segmented import get_key, set_key
    if "key" in holder:
        set_key(holder["key"])
    else:
        holder["key"] = get_key()


def _rows_ce(model, h_rows, t_rows):
    return nn.losses.cross_entropy(model.head(h_rows[None]), t_rows[None])[0]


def gathered_head_loss(model, h, targets, mask, chunk_size: int = 0, sel=None):
    """Head + CE only on the counted rows (optionally chunked + checkpointed)."""
    B, T, D = h.shape
    if sel is None:
        sel = selected_rows(mask)
    h_sel = h.reshape(B * T, D)[sel]
    t_sel = targets.reshape(B * T)[sel]
    M = int(sel.shape[0])
    if chunk_size and M > chunk_size:
        # Trainable parameters outside the blocks (e.g. LoRA on lm_head) must be
        # explicit checkpoint inputs, or their gradient would be dropped.
        names, arrays = _outer_trainable(model)
        from .segmented import has_dropout
        use_key = has_dropout(model)
        parts = []
        for s in range(0, M, chunk_size):
            holder = {}

            # targets ride in the closure (integer ids have no cotangent)
            def fn(hr, *ps, tr=t_sel[s:s + chunk_size], holder=holder):
                if names:
                    model.update(tree_unflatten(list(zip(names, ps))))
                _replay_key(holder, use_key)
                return _rows_ce(model, hr, tr)

            parts.append(mx.checkpoint(fn)(h_sel[s:s + chunk_size], *arrays))
        if names:
            model.update(tree_unflatten(list(zip(names, arrays))))
        ce_sel = mx.concatenate(parts)
    else:
        ce_sel = _rows_ce(model, h_sel, t_sel)
    ce = mx.zeros((B * T,), dtype=ce_sel.dtype).at[sel].add(ce_sel).reshape(B, T)
    return _reduce(ce, mask)


def head_loss(model, h, targets, mask, head: str = "full", chunk_size: int = 1024, sel=None):
    if head == "full":
        return full_head_loss(model, h, targets, mask)
    if head == "gather":
        return gathered_head_loss(model, h, targets, mask, 0, sel)
    if head == "chunked":
        return gathered_head_loss(model, h, targets, mask, chunk_size, sel)
    raise ValueError(f"unknown loss head {head!r}; have {HEADS}")


def split_batch(batch: mx.array, lengths: mx.array):
    inputs, targets = batch[:, :-1], batch[:, 1:]
    return inputs, targets, loss_mask(lengths, targets.shape[1])


def sft_loss(model, batch, lengths, head: str = "full", chunk_size: int = 1024):
    """(loss, ntoks) - `default_loss` semantics; `head` picks the loss head."""
    inputs, targets, mask = split_batch(batch, lengths)
    if head == "full":
        return _reduce(nn.losses.cross_entropy(model(inputs), targets), mask)
    h = hidden_states(model, inputs)
    return head_loss(model, h, targets, mask, head, chunk_size)


def hidden_states(model, inputs, checkpoint: bool = False):
    """The last block's output (before the final norm) via the segment protocol;
    `checkpoint` recomputes each block in the backward (mx.checkpoint)."""
    h, ctx = model.begin(inputs)
    if not checkpoint:
        for i in range(len(model.layers)):
            h = model.layer_step(i, h, ctx)
        return h
    from .segmented import checkpointed_layers
    return checkpointed_layers(model, h, ctx)


# --- loss head, chunk by chunk -------------------------------------------------------

def chunked_head_vjp(model, outer_names, outer, h, targets, mask, chunk_size, sel, key):
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
    from .segmented import set_key
    from .token_chunk import bind, cat
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
        bind(model, outer_names, ps)
        return [_rows_ce(model, hr, tr)]

    ces, dhs, acc = [], [], None
    for a in range(0, M, step):
        b = min(a + step, M)
        (ce_c,), g = mx.vjp(lambda hr, *ps, tr=t_sel[a:b]: fn(hr, *ps, tr=tr),
                            [h_sel[a:b], *outer], [d_ce[a:b]])
        acc = list(g[1:]) if acc is None else [x + y for x, y in zip(acc, g[1:])]
        ces.append(ce_c)
        dhs.append(g[0])
        mx.eval(ce_c, g[0], acc)
    bind(model, outer_names, outer)
    del h_sel, g
    loss = reduce(cat(ces, 0))[0]
    dh_sel = cat(dhs, 0)
    del dhs
    dh = mx.zeros((B * T, D), dtype=h.dtype).at[sel].add(dh_sel).reshape(B, T, D)
    return loss, dh, acc
