"""The fast path's own settings, typed: `FastConfig`, one frozen value resolved together with
the `Levers` (engine.levers.resolve: preset < environment < flag) and carried by them
(`Levers.fast`). Nothing else in engine/fast reads the environment.

| field | environment | values | what it does |
|---|---|---|---|
| `prof` | `MLXP_MEGA_PROF` | 0/1 | the one-kernel step's phase timer (`FastDecoder.mega_profile`) |
| `qk_norm` | `MLXP_MEGA_QKNORM` | 0/1 | qwen3 (per-head q/k norms) on the one-kernel step (0: off it) |
| `disabled` | `MLXP_DISABLE_KERNELS` | a comma list of `KERNELS` (add_rms, rope_qkv, attention, gemv, mega, qmm) | kernels switched off: their stock-MLX references run instead |
| `deterministic` | (`--deterministic`) | bool | batch-invariant kernels (issue #41's GPU part): set by `engine.deterministic.check`; not built yet, so `engine.fast.apply.fast_step_for` refuses it |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

KERNELS = ("add_rms", "rope_qkv", "attention", "gemv", "mega", "qmm")


class FastConfigError(ValueError):
    """A fast-path setting that cannot be understood (the message names it)."""


@dataclass(frozen=True)
class FastConfig:
    prof: bool = False
    qk_norm: bool = True
    disabled: frozenset = field(default_factory=frozenset)
    deterministic: bool = False        # batch-invariant kernels (not built yet: refused)

    def __post_init__(self):
        for name in ("prof", "qk_norm", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise FastConfigError(f"{name} must be True or False, not {getattr(self, name)!r}")
        object.__setattr__(self, "disabled", frozenset(self.disabled))
        bad = sorted(self.disabled - set(KERNELS))
        if bad:
            raise FastConfigError(f"MLXP_DISABLE_KERNELS (disabled) names unknown kernels {bad}: "
                                  f"one of {', '.join(KERNELS)}")

    def as_dict(self) -> dict:
        return {"prof": self.prof, "qk_norm": self.qk_norm,
                "disabled": sorted(self.disabled)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "FastConfig":
        """The settings named in `env` (a mapping: the caller decides whether it is the process environment);
        a bad value is a FastConfigError that names the variable."""
        def switch(name):
            raw = env.get(name, "")
            if raw not in ("", "0", "1"):
                raise FastConfigError(f"{name} must be 0 or 1, not {raw!r}")
            return None if raw == "" else raw == "1"
        qkn = switch("MLXP_MEGA_QKNORM")
        return cls(prof=bool(switch("MLXP_MEGA_PROF")),
                   qk_norm=qkn is not False,
                   disabled=frozenset(k for k in env.get("MLXP_DISABLE_KERNELS", "").split(",") if k))
