"""Merged projections: q/k/v (and gate/up) as one matrix, one matmul per layer.

The model files are left as they are: each merged group replaces the separate
`nn.Linear` / `nn.QuantizedLinear` modules with `Part` modules that share one
`MergedLinear`. The first part called with an input computes the whole matmul,
splits it along the last axis, and the other parts return their slice for the
same input object. Quantized weights merge too: packed rows, scales and biases
are all per output row, so concatenating them along the rows is exact.

On MLX's CPU backend a row of `x @ W.T` does not depend on which other rows are
computed with it, so merged logits are bit-identical to the separate ones
(tests/parity/test_levers_l1.py checks that against mlx-lm). Modules that are
not plain Linear layers (LoRA-wrapped ones, say) are left alone.

A merged group can be split again (`unmerge_paths`): each projection gets back a
plain module whose rows are a slice of the merged matrix, the same values, so the
output is unchanged bit for bit. engine.adapters.lora does that before it mounts an adapter
onto a merged projection, and merges the group again once no adapter is left on
it (`remerge`: only on models `merge_projections` ran on).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_FLAG = "_mlxp_merged_proj"     # set on a model once merge_projections ran on it
_VERSION = "_mlxp_module_version"


def module_version(model) -> int:
    """A counter bumped whenever the model's projections change form (merged, split, an
    adapter mounted, unmounted or switched): a step traced once (engine.fast.decode's
    compiled step) is valid only for the version it was traced at."""
    return getattr(model, _VERSION, 0)


def bump_version(model) -> None:
    object.__setattr__(model, _VERSION, module_version(model) + 1)


class _Memo:
    """Last input and outputs of a MergedLinear (a plain object, so not a parameter)."""
    __slots__ = ("x", "outs")

    def __init__(self):
        self.x, self.outs = None, None


class MergedLinear(nn.Module):
    """One Linear / QuantizedLinear whose output rows are the concatenated parts."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.linear = linear
        self.sizes = sizes
        self._splits = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        self._memo = _Memo()

    def __call__(self, x) -> list:
        return mx.split(self.linear(x), self._splits, axis=-1)

    def part(self, i: int, x):
        m = self._memo
        if m.x is not x:
            m.x, m.outs = x, self(x)
        out = m.outs[i]
        if i == len(self.sizes) - 1:
            m.x, m.outs = None, None        # every part has been read: drop the references
        return out


class _Ref:
    __slots__ = ("merged",)

    def __init__(self, merged):
        self.merged = merged


class Part(nn.Module):
    """Stands where one of the separate projections stood."""

    def __init__(self, merged: MergedLinear, index: int):
        super().__init__()
        self._ref = _Ref(merged)            # a plain object: not registered twice as a child
        self.index = index

    @property
    def merged(self) -> MergedLinear:
        return self._ref.merged

    def __call__(self, x):
        return self._ref.merged.part(self.index, x)


def _mergeable(mods) -> bool:
    t = type(mods[0])
    if t not in (nn.Linear, nn.QuantizedLinear) or any(type(m) is not t for m in mods):
        return False
    if t is nn.QuantizedLinear:
        q = [(m.group_size, m.bits, getattr(m, "mode", "affine")) for m in mods]
        if len(set(q)) != 1:
            return False
    has_bias = ["bias" in m for m in mods]
    return all(has_bias) or not any(has_bias)


def _quantized_from(like: nn.Module, array_for) -> nn.Module:
    """A frozen QuantizedLinear with `like`'s quantization and arrays `array_for(key)`
    for each of its weight / scales / biases / bias."""
    lin = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
    nn.Module.__init__(lin)
    lin.group_size, lin.bits = like.group_size, like.bits
    if hasattr(like, "mode"):
        lin.mode = like.mode
    for key in ("weight", "scales", "biases", "bias"):
        if key in like:
            lin[key] = array_for(key)
    lin.freeze()
    return lin


def merge_linears(mods) -> Optional[MergedLinear]:
    """A MergedLinear over `mods` (same type/quantization), or None if they cannot merge."""
    if not _mergeable(mods):
        return None
    first = mods[0]
    if type(first) is nn.QuantizedLinear:
        lin = _quantized_from(first, lambda key: mx.concatenate([m[key] for m in mods], axis=0))
        sizes = [m.scales.shape[0] for m in mods]
    else:
        lin = nn.Linear(1, 1, bias="bias" in first)
        lin.weight = mx.concatenate([m.weight for m in mods], axis=0)
        if "bias" in first:
            lin.bias = mx.concatenate([m.bias for m in mods], axis=0)
        sizes = [m.weight.shape[0] for m in mods]
    return MergedLinear(lin, sizes)


def _merged_name(names) -> str:
    return "merged_" + "_".join(k.split("_")[0] for k in names)


def merge_projections(model) -> int:
    """Merge q/k/v and gate/up in every layer that has them; returns the groups merged.
    The model is marked as merged: `remerge` merges groups freed later (adapters gone)."""
    object.__setattr__(model, _FLAG, True)
    n = 0
    for layer in getattr(model, "layers", []):
        for parent_name, names in GROUPS:
            parent = getattr(layer, parent_name, None)
            if parent is None or not all(k in parent for k in names):
                continue
            if isinstance(parent[names[0]], Part):
                continue
            merged = merge_linears([parent[k] for k in names])
            if merged is None:
                continue
            parent[_merged_name(names)] = merged
            for i, k in enumerate(names):
                parent[k] = Part(merged, i)
            n += 1
    if n:
        mx.eval(model.parameters())
        bump_version(model)
    return n


def merged_of(parent, names) -> Optional[MergedLinear]:
    """The MergedLinear behind `names` in a layer's attention / MLP, if merged."""
    p = parent[names[0]] if names[0] in parent else None
    return p.merged if isinstance(p, Part) else None


def is_merged(model) -> bool:
    """Whether `merge_projections` ran on this model (the merged_proj lever is on)."""
    return bool(getattr(model, _FLAG, False))


def remerge(model) -> int:
    """Merge the groups that can merge again (no adapter left on them), on a model that
    `merge_projections` ran on; 0 on any other model."""
    return merge_projections(model) if is_merged(model) else 0


def _row_slice(lin: nn.Module, start: int, stop: int) -> nn.Module:
    """A plain Linear / QuantizedLinear holding rows [start, stop) of `lin` (same values)."""
    if type(lin) is nn.QuantizedLinear:
        return _quantized_from(lin, lambda key: lin[key][start:stop])
    out = nn.Linear(1, 1, bias="bias" in lin)
    out.weight = lin.weight[start:stop]
    if "bias" in lin:
        out.bias = lin.bias[start:stop]
    return out


def unmerge_group(parent, names) -> bool:
    """Put separate projections back where a merged group stands; False if not merged."""
    merged = merged_of(parent, names)
    if merged is None:
        return False
    start = 0
    for k, size in zip(names, merged.sizes):
        parent[k] = _row_slice(merged.linear, start, start + size)
        start += size
    del parent[_merged_name(names)]
    return True


def unmerge_paths(model, paths) -> int:
    """Split every merged group that holds one of `paths` (full module paths such as
    `model.layers.0.self_attn.q_proj`); returns the groups split."""
    modules = dict(model.named_modules())
    n = 0
    for path in paths:
        parent_path, _, name = str(path).rpartition(".")
        parent = modules.get(parent_path)
        if not isinstance(parent, nn.Module) or not isinstance(parent.get(name), Part):
            continue
        group = next((g for _, g in GROUPS if name in g), None)
        if group is not None and unmerge_group(parent, group):
            n += 1
    if n:
        mx.eval(model.parameters())
        bump_version(model)
    return n
