"""The adapter registry: LoRA adapters mounted at runtime, selected per request.

An `Engine` uses it to switch the adapters a request asked for on before it
runs and to keep prompt-cache entries apart per adapter stack. Every method
that touches the model must run on the thread that runs the engine (the
server's worker), so a mount never races a forward pass. Bad input raises
`AdapterRequestError` (a `ValueError` naming the request field in `.param`).

- `mount(id, path)`: all-or-nothing (engine.adapters.lora validates every tensor
  before touching the model; any mismatch is an `AdapterRequestError`).
- `activate(ids)`: before each generation, exactly the requested adapters
  are active, the rest are switched off (an inactive adapter leaves the base
  output bit for bit).
- `namespace(ids)`: the prompt-cache namespace of an adapter stack. It names
  each adapter with its mount generation, so KV computed under one stack is
  never reused by another (nor by a later adapter mounted under the same id).
"""

from __future__ import annotations

from contextlib import contextmanager
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional

BASE_NAMESPACE = "base"


class AdapterRequestError(ValueError):
    """A request named an adapter wrongly; `param` is the request field at fault."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class UnknownAdapter(AdapterRequestError, KeyError):
    """No adapter with that id is mounted."""

    def __str__(self):
        return self.args[0]


@dataclass
class Mounted:
    id: str
    path: str
    rank: int
    scale: float
    size_bytes: int
    mounted_layers: int
    generation: int
    namespaces: set = field(default_factory=set)

    def describe(self) -> dict:
        return {"id": self.id, "path": self.path, "rank": self.rank, "scale": self.scale,
                "size_bytes": self.size_bytes, "mounted_layers": self.mounted_layers}


class AdapterRegistry:
    def __init__(self, model, prompt_cache=None):
        self.model = model
        self.prompt_cache = prompt_cache
        self.mounted: "dict[str, Mounted]" = {}   # insertion order = mount order
        self._gen = itertools.count(1)
        self._active: Optional[tuple] = None

    # --- request side (no MLX) ---------------------------------------------

    def resolve(self, spec) -> tuple:
        """Adapter ids of a request's `adapter` field, in mount order.

        "id", "a+b" / "a,b" (stacked), "none" or "" (the base model), or a list."""
        if spec is None:
            return ()
        if isinstance(spec, str):
            parts = spec.replace(",", "+").split("+")
        elif isinstance(spec, list) and all(isinstance(x, str) for x in spec):
            parts = spec
        else:
            raise AdapterRequestError('adapter must be a string ("id", "a+b" or "none")',
                                      param="adapter")
        # ("none" / "base" name the base model: in a stack they add nothing, as in a list)
        names = [p.strip() for p in parts if p.strip() and p.strip().lower() not in ("none", "base")]
        for n in names:
            if n not in self.mounted:
                have = ", ".join(self.mounted) or "(none)"
                shown = n if len(n) <= 64 else n[:64] + "..."
                raise UnknownAdapter(f'unknown adapter "{shown}" - mounted: {have}',
                                     param="adapter")
        order = list(self.mounted)
        return tuple(sorted(set(names), key=order.index))

    def namespace(self, ids: Iterable[str]) -> str:
        ids = tuple(ids)
        if not ids:
            return BASE_NAMESPACE
        for i in ids:          # (resolved when the request came; an unmount ran since)
            if i not in self.mounted:
                raise UnknownAdapter(f'adapter "{i}" was unmounted before the request ran',
                                     param="adapter")
        ns = "+".join(f"{i}#{self.mounted[i].generation}" for i in ids)
        for i in ids:
            self.mounted[i].namespaces.add(ns)
        return ns

    def disk_key(self, ids: Iterable[str]) -> str:
        """The adapter stack's name in prompt-cache files: each adapter's id, files and
        scale (stable across restarts, unlike `namespace`)."""
        from engine.kv.disk_dir import fingerprint

        return "+".join(f"{i}:{fingerprint(self.mounted[i].path, extra=str(self.mounted[i].scale))}"
                        for i in ids)

    def list(self) -> list:
        return [m.describe() for m in self.mounted.values()]

    # --- worker side (touch the model) --------------------------------------

    def mount(self, adapter_id: str, path: str, scale: Optional[float] = None) -> Mounted:
        import engine.adapters.lora as lora, engine.adapters.mount as lora_mount

        if not isinstance(adapter_id, str) or not adapter_id.strip() or any(
                c in adapter_id for c in "+, /") or adapter_id.lower() in ("none", "base"):
            raise AdapterRequestError("adapter id must be a non-empty string without '+', ',', "
                                      "'/' or spaces, and not 'none'", param="id")
        if adapter_id in self.mounted:
            raise AdapterRequestError(f'an adapter with id "{adapter_id}" is already mounted',
                                      param="id")
        try:
            lora_mount.mount_adapter(self.model, path, name=adapter_id, scale=scale)
        except (lora.AdapterError, OSError, ValueError, KeyError) as e:
            raise AdapterRequestError(f"cannot mount adapter {adapter_id!r}: {e}",
                                      param="path") from None
        info = lora_mount.mounted_adapters(self.model)[adapter_id]
        cfg = info["config"]
        size = lora_mount.adapter_nbytes(self.model, adapter_id)
        mounted = Mounted(id=adapter_id, path=str(path), rank=int(cfg["lora_parameters"]["rank"]),
                          scale=float(info["scale"]), size_bytes=int(size),
                          mounted_layers=int(info["layers"]), generation=next(self._gen))
        self.mounted[adapter_id] = mounted
        self._active = None
        # a new adapter starts inactive until a request selects it
        lora_mount.set_adapter(self.model, adapter_id, active=False)
        return mounted

    def unmount(self, adapter_id: str) -> dict:
        import engine.adapters.mount as lora_mount

        m = self.mounted.get(adapter_id)
        if m is None:
            raise UnknownAdapter(f'no adapter "{adapter_id}" is mounted', param="id")
        lora_mount.unmount_adapter(self.model, adapter_id)
        del self.mounted[adapter_id]
        self._active = None
        if self.prompt_cache is not None:
            for ns in m.namespaces:
                self.prompt_cache.clear(ns)
        return {"id": adapter_id, "removed_layers": m.mounted_layers}

    @contextmanager
    def base_model(self):
        """No adapter active for the duration (an embeddings forward between two steps),
        the previous set again after. Worker thread."""
        prev = self._active
        self.activate(())
        try:
            yield
        finally:
            if prev is not None:
                self.activate(prev)

    def activate(self, ids: tuple) -> None:
        """Exactly `ids` active (called on the worker before each generation)."""
        if ids == self._active:
            return
        import engine.adapters.mount as lora_mount

        for i in ids:
            if i not in self.mounted:
                raise ValueError(f'adapter "{i}" was unmounted before the request ran')
        for name in self.mounted:
            lora_mount.set_adapter(self.model, name, active=name in ids)
        self._active = ids
