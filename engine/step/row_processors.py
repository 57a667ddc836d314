"""The logits processors of a group of batch rows (engine.step.batch): a leading run of
logit-bias processors applied to every row at once (one scatter-add), the rest row by row."""

from __future__ import annotations

import mlx.core as mx


def split_bias(procs):
    """(leading logit-bias processors, the rest) of one row's processor list."""
    procs = list(procs)
    k = 0
    while k < len(procs) and getattr(procs[k], "bias", None) is not None:
        k += 1
    return procs[:k], procs[k:]


def batched(proc_lists):
    """Built when the group's rows change, from each row's processor list: the batched bias —
    (row index [N], token id [N], bias [N], largest id) over every row's leading logit-bias
    processors, or None — and each row's remaining processors."""
    r_idx, c_idx, vals, top, rest = [], [], [], -1, []
    for e, procs in enumerate(proc_lists):
        lead, after = split_bias(procs)
        rest.append(after)
        for p in lead:
            ids, _, add, t = p.bias
            r_idx += [e] * len(ids)
            c_idx += ids
            vals.append(add)
            top = max(top, t)
    bias = None if not r_idx else (mx.array(r_idx, dtype=mx.int32),
                                   mx.array(c_idx, dtype=mx.int32), mx.concatenate(vals), top)
    return bias, rest


def apply_processors(lg, procs, ctx):
    """One row's logits through its processors, in order."""
    for p in procs:
        lg = p(ctx, lg)
    return lg
