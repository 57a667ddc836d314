"""Adapters mounted at run time: mount, switch, stack, unmount (inference only).

A mounted adapter wraps its target projections in `engine.adapters.lora.LoRALinear`
(the first adapter on a layer in the primary slot, as `mlx_lm.load(path,
adapter_path=...)` builds it; later ones stacked, summed in mount order) and is
remembered in a per-model registry by name. Mounting is all-or-nothing: every
tensor is checked before anything is touched. Projections merged by the
`merged_proj` lever are split back into separate modules (the same values) before
an adapter mounts onto them, and merge again when their last adapter leaves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from engine.fast.merge import bump_version, remerge, unmerge_paths
from engine.adapters.lora import (TARGET_TYPES, AdapterError, LoRALinear, get_module, input_dims, read_adapter,
                   set_module)
from engine.adapters.switch import LoRASwitchLinear


def _group_weights(weights: dict, where) -> dict:
    groups: dict[str, dict] = {}
    for name, w in weights.items():
        path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if leaf not in ("lora_a", "lora_b"):
            raise AdapterError(f"{where}: {name}: not a LoRA tensor (expected .lora_a/.lora_b)")
        groups.setdefault(path, {})[leaf] = w
    for path, g in groups.items():
        if set(g) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{where}: {path} has only {sorted(g)}")
    return groups


_ACTIVE = "_mlxp_active_adapters"


def active_adapters(model) -> tuple:
    """Names of the mounted adapters switched on (sorted): with `module_version`, what a
    traced step of this model depends on (`engine.fast.decode.FastStep` keys its traces on
    both; switching adapters on and off does not bump the version)."""
    return getattr(model, _ACTIVE, ())


def _set_active(model, names) -> None:
    object.__setattr__(model, _ACTIVE, tuple(sorted(names)))


def _registry(model) -> dict:
    reg = model.__dict__.get("_lora_registry")
    if reg is None:
        reg = {}
        object.__setattr__(model, "_lora_registry", reg)
    return reg


def _plan(model, groups: dict, adapter_dir) -> list:
    """(path, module, A, B) per target, every shape checked (nothing touched yet)."""
    plan = []
    for path, g in groups.items():
        try:
            m = get_module(model, path)
        except (AttributeError, IndexError, ValueError, KeyError):
            raise AdapterError(f"{adapter_dir}: {path}: no such module in the model") from None
        base = m.linear if isinstance(m, LoRALinear) else m
        if not isinstance(base, TARGET_TYPES):
            raise AdapterError(f"{adapter_dir}: {path} is a {type(base).__name__}, not a linear")
        a, b = g["lora_a"], g["lora_b"]
        want_a = (input_dims(base), a.shape[-1])
        want_b = (a.shape[-1], base.weight.shape[0])
        if a.ndim != 2 or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(f"{adapter_dir}: {path}: lora_a {tuple(a.shape)} / lora_b "
                               f"{tuple(b.shape)} do not fit a {want_a[0]}->{want_b[1]} linear")
        plan.append((path, m, a, b))
    return plan


def mount_adapter(model, adapter_dir, name: Optional[str] = None,
                  scale: Optional[float] = None) -> str:
    """Apply an mlx-lm-format adapter to `model` (inference; nothing trainable).

    The first adapter on a layer goes into its primary slot - the same module
    tree and forward as `mlx_lm.load(path, adapter_path=...)`; later ones stack
    on top (summed in mount order). Returns the adapter's name."""
    cfg, weights = read_adapter(adapter_dir)
    name = name or Path(adapter_dir).name or "default"
    reg = _registry(model)
    if name in reg:
        raise AdapterError(f"an adapter named {name!r} is already mounted")
    s = float(cfg["lora_parameters"]["scale"] if scale is None else scale)
    rank = int(cfg["lora_parameters"]["rank"])
    groups = _group_weights(weights, adapter_dir)
    # merged q/k/v or gate/up projections (the merged_proj lever) holding a target are
    # split back into separate modules first: the same values, so the same output
    split = unmerge_paths(model, groups)
    try:
        plan = _plan(model, groups, adapter_dir)
    except AdapterError:
        if split:
            remerge(model)
        raise
    slots = []
    for path, m, a, b in plan:
        if not isinstance(m, LoRALinear):
            m = LoRALinear(m, rank=rank, scale=s, with_primary=False, primary_name=name)
            set_module(model, path, m)
        if not m.has_primary:
            m.lora_a, m.lora_b = a, b
            m.scale, m.rank, m.enabled, m.primary_name = s, a.shape[1], True, name
            m.freeze(keys=["lora_a", "lora_b"], strict=False)
            slots.append((path, "primary"))
        else:
            m._stack.items.append({"name": name, "a": a, "b": b, "scale": s, "active": True})
            slots.append((path, "stack"))
    mx.eval([a for _, _, a, _ in plan] + [b for _, _, _, b in plan])
    reg[name] = {"path": str(adapter_dir), "scale": s, "slots": slots, "config": cfg}
    _set_active(model, set(active_adapters(model)) | {name})   # (mounted switched on)
    bump_version(model)
    return name


def _slot_modules(model, name):
    reg = _registry(model)
    if name not in reg:
        raise AdapterError(f"no adapter named {name!r} is mounted (have {sorted(reg)})")
    for path, kind in reg[name]["slots"]:
        yield path, kind, get_module(model, path)


def set_adapter(model, name: str, *, active: Optional[bool] = None,
                scale: Optional[float] = None):
    """Switch a mounted adapter on/off or change its scale (0 = the base output)."""
    for path, kind, m in _slot_modules(model, name):
        if kind == "primary":
            if active is not None:
                m.enabled = bool(active)
            if scale is not None:
                m.scale = float(scale)
        else:
            it = m._stack.find(name)
            if active is not None:
                it["active"] = bool(active)
            if scale is not None:
                it["scale"] = float(scale)
    if scale is not None:
        _registry(model)[name]["scale"] = float(scale)
        bump_version(model)
    if active is not None:      # (a traced step keys on this: switching back reuses its trace)
        on = set(active_adapters(model))
        _set_active(model, on | {name} if active else on - {name})



def unmount_adapter(model, name: str):
    """Remove a mounted adapter; layers left with no adapter get their base back."""
    reg = _registry(model)
    for path, kind, m in list(_slot_modules(model, name)):
        if kind == "primary":
            del m["lora_a"], m["lora_b"]
            if m._stack.items:  # promote the next stacked adapter into the primary slot
                it = m._stack.items.pop(0)
                m.lora_a, m.lora_b, m.scale, m.enabled, m.primary_name = (
                    it["a"], it["b"], it["scale"], it["active"], it["name"])
                m.freeze(keys=["lora_a", "lora_b"], strict=False)
                slots = reg[it["name"]]["slots"]
                slots[slots.index((path, "stack"))] = (path, "primary")
        else:
            m._stack.items = [it for it in m._stack.items if it["name"] != name]
        if not m.has_primary and not m._stack.items:
            set_module(model, path, m.linear)
    del reg[name]
    _set_active(model, set(active_adapters(model)) - {name})
    bump_version(model)
    remerge(model)          # merged_proj: groups left without an adapter merge again


def adapter_nbytes(model, name: str) -> int:
    """Bytes of a mounted adapter's A and B matrices."""
    size = 0
    for _, kind, m in _slot_modules(model, name):
        if kind == "primary":
            size += m.lora_a.nbytes + m.lora_b.nbytes
        else:
            it = m._stack.find(name)
            size += it["a"].nbytes + it["b"].nbytes
    return size


def mounted_adapters(model) -> dict:
    """name -> {path, scale, active layers, config} of the adapters mounted at runtime."""
    out = {}
    for name, info in _registry(model).items():
        out[name] = {"path": info["path"], "scale": info["scale"], "layers": len(info["slots"]),
                     "config": info["config"]}
    return out


def remove_lora(model):
    """Unwrap every LoRA layer (drops all adapters, primary and stacked)."""
    for path, m in [(p, m) for p, m in model.named_modules()
                    if isinstance(m, (LoRALinear, LoRASwitchLinear))]:
        set_module(model, path, m.linear)
    _registry(model).clear()
    bump_version(model)
    remerge(model)
    return model


__all__ = ["adapter_nbytes", "mount_adapter", "mounted_adapters", "remove_lora",
           "set_adapter", "unmount_adapter"]
