"""Decode performance levers and the tier presets that switch them.

Each lever is an A/B switch with a CLI flag and an environment variable:

| lever | flag | env | tier | what it does |
|---|---|---|---|---|
| merged_proj | --merged-proj | MLXP_MERGED_PROJ | L1 | q/k/v and gate/up weights stored as one matrix each; the model's own projections become row views of it |
| compiled_decode | --compiled-decode | MLXP_COMPILED_DECODE | L3 | the decode step is traced once (`mx.compile`) over a preallocated cache whose write position lives on the device |
| perf_kernel | --perf-kernel | MLXP_PERF_KERNEL | L3 | fused kernels in the compiled step: residual add + RMSNorm, RoPE + q/k/v split |
| fused_sdpa | --fused-sdpa | MLXP_FUSED_SDPA | L3 | a decode-attention kernel that reads only the filled part of the preallocated cache |
| force_wire | --force-wire | MLXP_FORCE_WIRE | L1 | keep the model's weights wired in memory (Metal only; a no-op elsewhere) |

`merged_proj` is bit-exact with the separate projections on the CPU (tests/parity
proves it against mlx-lm), so it belongs to L1. The compiled step attends over a
preallocated buffer and uses different kernels, which changes rounding: it is L3,
opt-in, and gated by KL against L1 (parity/l3_gate.py).

The CUDA kernels exist only on an NVIDIA GPU; elsewhere `perf_kernel` and
`fused_sdpa` run the same math with stock MLX ops, so every switch runs on the CPU.

With a fast lever on, every decode step runs on the fast runner (engine.fast): the rows of
the continuous batch, any number of them, and a request that runs alone.

Resolution order: tier preset < environment variables < explicit flags. With a fast lever
on, the fast path's own settings (`engine.fast.config.FastConfig`: the one-kernel step's
switches, kernels switched off) are resolved here too, from the same environment, and carried
as `Levers.fast`; this module is the one place that reads them.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Mapping, Optional

from .fast.config import FastConfig, FastConfigError

TIERS = ("l1", "l2", "l3")
LEVER_NAMES = ("merged_proj", "compiled_decode", "perf_kernel", "fused_sdpa", "force_wire")


@dataclass(frozen=True)
class Levers:
    tier: str = "l1"
    merged_proj: bool = False
    compiled_decode: bool = False
    perf_kernel: bool = False
    fused_sdpa: bool = False
    force_wire: bool = False
    fast: FastConfig = field(default_factory=FastConfig)     # the fast path's own settings

    @property
    def fast_decode(self) -> bool:
        """Whether decode steps leave the L1 path for engine.fast.decode's step."""
        return self.compiled_decode or self.perf_kernel or self.fused_sdpa

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "fast"}
        return {**out, "fast": self.fast.as_dict()}


# L1 keeps mlx-lm's exact kernels and order; L2 changes only the KV cache (kv_config),
# which is chosen elsewhere; L3 turns on every lever.
PRESETS: dict[str, dict[str, bool]] = {
    "l1": dict(merged_proj=False, compiled_decode=False, perf_kernel=False, fused_sdpa=False),
    "l2": dict(merged_proj=False, compiled_decode=False, perf_kernel=False, fused_sdpa=False),
    "l3": dict(merged_proj=True, compiled_decode=True, perf_kernel=True, fused_sdpa=True),
}


class LeverError(ValueError):
    """A tier or lever value that cannot be understood."""


def _env_name(lever: str) -> str:
    return "MLXP_" + lever.upper()


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no", ""):
        return False
    raise LeverError(f"{name} must be on/off (1/0, true/false), got {value!r}")


def fast_config(env: Mapping[str, str]) -> FastConfig:
    """The fast path's settings named in `env`, a bad value a LeverError naming it."""
    try:
        return FastConfig.from_env(env)
    except FastConfigError as e:
        raise LeverError(str(e)) from None


def resolve(tier: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
            fast: Optional[FastConfig] = None, **flags: Optional[bool]) -> Levers:
    """The levers in force: the tier's preset (tier, else $MLXP_TIER, else l1), then any
    MLXP_<LEVER> environment variable, then explicit flags (None = not given). With a fast
    lever on, `Levers.fast` is `fast` if given, else the settings in the environment
    (`fast_config`); with none on, the defaults (the environment's are not read)."""
    env = os.environ if env is None else env
    unknown = set(flags) - set(LEVER_NAMES)
    if unknown:
        raise LeverError(f"unknown lever(s): {', '.join(sorted(unknown))}")
    tier = (tier or env.get("MLXP_TIER") or "l1").lower()
    if tier not in TIERS:
        raise LeverError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
    values = dict(PRESETS[tier])
    for name in LEVER_NAMES:
        if _env_name(name) in env:
            values[name] = _parse_bool(_env_name(name), env[_env_name(name)])
    for name, v in flags.items():
        if v is not None:
            values[name] = bool(v)
    lv = Levers(tier=tier, **values)
    if lv.fast_decode:
        lv = replace(lv, fast=fast if fast is not None else fast_config(env))
    return lv


def for_tier(tier: str) -> Levers:
    """A tier preset's levers alone (no environment, no flags): a draft model's
    (engine-serve --draft-tier)."""
    return resolve(tier, env={})


def add_lever_args(p: argparse.ArgumentParser) -> None:
    """--tier l1|l2|l3 (and --l1/--l2/--l3), plus one --X / --no-X switch per lever."""
    g = p.add_argument_group("performance levers")
    g.add_argument("--tier", choices=TIERS, default=None,
                   help="tier preset (default: $MLXP_TIER or l1); explicit lever flags override it")
    for t in TIERS:
        g.add_argument(f"--{t}", dest="tier", action="store_const", const=t,
                       help=f"same as --tier {t}")
    for name in LEVER_NAMES:
        g.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                       action=argparse.BooleanOptionalAction,
                       help=f"lever {name} on/off (env {_env_name(name)})")


def levers_from_args(args: argparse.Namespace, env: Optional[Mapping[str, str]] = None) -> Levers:
    """The levers a CLI asked for; with a fast lever on, the fast path's own settings
    (engine.fast.config.FastConfig) are resolved too, so that a bad value is a LeverError
    here, not at the first decode step."""
    return resolve(getattr(args, "tier", None), env, **{n: getattr(args, n, None) for n in LEVER_NAMES})


def with_levers(levers: Levers, **changes) -> Levers:
    """A copy with some levers changed (for A/B runs)."""
    names = {f.name for f in fields(Levers)}
    bad = set(changes) - names
    if bad:
        raise LeverError(f"unknown lever(s): {', '.join(sorted(bad))}")
    return replace(levers, **changes)


def parse_spec(spec: str, env: Optional[Mapping[str, str]] = None) -> Levers:
    """A tier with levers switched, as benchmarks name them: `l3`, `l3-compiled_decode`
    (l3 without that lever), `l1+merged_proj` (l1 with it). The levers' environment
    variables are not consulted: a spec says everything; the fast path's own settings come
    from `env` (default: the environment), as for `resolve`."""
    parts = re.split(r"([+-])", spec)
    lv = resolve(parts[0], env={})
    for sign, name in zip(parts[1::2], parts[2::2]):
        if name not in LEVER_NAMES:
            raise LeverError(f"unknown lever {name!r} in {spec!r}")
        lv = with_levers(lv, **{name: sign == "+"})
    if lv.fast_decode:
        lv = replace(lv, fast=fast_config(os.environ if env is None else env))
    return lv
