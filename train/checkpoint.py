"""Per-block gradient checkpointing and the PRNG bookkeeping shared by the loss
heads and the segmented backward (one module both import, so neither imports
the other)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from .token_chunk import bind


# --- PRNG key save/restore (mx.random.seed((hi << 32) | lo) recreates a key) ---

def get_key() -> tuple[int, int]:
    hi, lo = (int(v) for v in mx.random.state[0].tolist())
    return hi, lo


def set_key(key: tuple[int, int]):
    mx.random.seed((key[0] << 32) | key[1])


def donors(model) -> tuple:
    d = getattr(model, "donor", None)
    return tuple(d) if d is not None else tuple(range(len(model.layers)))


def has_dropout(model) -> bool:
    import mlx.nn as nn
    return any(isinstance(m, nn.Dropout) and getattr(m, "_p_1", 1.0) < 1.0
               for _, m in model.named_modules())


def local_ctx(ctx, n, kv_in: dict, pli=None):
    c = dict(ctx)
    if "kv" in ctx:
        kv = [None] * n
        for d, (k, v, rest) in kv_in.items():
            kv[d] = (k, v, *rest)
        c["kv"] = kv
    if pli is not None:
        c["pli"] = pli
    return c



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
            c = local_ctx(ctx, n, kv_in, pli_)
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
