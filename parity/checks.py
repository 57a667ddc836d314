"""The L1/L2 forward checks, defined once: tests parametrize over them and
`python -m parity.report` runs them all into a versioned report."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import mlx.core as mx

from engine.kv.quant import make_policy
from engine.loader import load_model as load_ours

from .compare import Comparison, run_schedule
from .fixtures.models import FAMILIES, SLIDING, VOCAB, cpu_dtypes, ensure_fixture
PROMPT_LENS = {"short": 9, "long": 40}   # "long" exceeds the 16-token sliding window
DECODE_STEPS = 32


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of n ids, avoiding the low special-token ids."""
    return [16 + (seed * 7919 + i * 104729) % (VOCAB - 16) for i in range(n)]


@dataclass(frozen=True)
class ForwardCheck:
    family: str
    dtype: str = "float32"
    prompt: str = "short"
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    shards: int = 1

    @property
    def tier(self) -> str:
        return "L2" if self.kv_bits and self.family in SLIDING else "L1"

    @property
    def name(self) -> str:
        kv = f"-kv{self.kv_bits}g{self.kv_group_size}s{self.quantized_kv_start}" if self.kv_bits else ""
        sh = f"-sharded{self.shards}" if self.shards > 1 else ""
        return f"{self.family}-{self.dtype}-{self.prompt}{kv}{sh}"


def forward_checks() -> list[ForwardCheck]:
    out = [ForwardCheck(f, d, p) for f in FAMILIES for d in cpu_dtypes(f) for p in PROMPT_LENS]
    for f in FAMILIES:
        group = 64 if f == "llama" else 32
        for bits in (8, 4):
            for start in (0, 12):
                out.append(ForwardCheck(f, "float32", "long", bits, group, start))
        # bf16 weights with 8-bit KV (MoE families: bf16 activations over q8 experts)
        out.append(ForwardCheck(f, "bfloat16" if "bfloat16" in cpu_dtypes(f) else "q8",
                                "long", 8, 32, 0))
    out.append(ForwardCheck("llama", "float32", "long", 4, 32, 0))
    out.append(ForwardCheck("llama", "float32", "long", shards=2))
    return out


@lru_cache(maxsize=8)
def _ours(path: str):
    return load_ours(path)[0]


def run_forward_check(c: ForwardCheck, ours_model=None) -> Comparison:
    from .oracles import mlx_lm_oracle as oracle

    path = str(ensure_fixture(c.family, c.dtype, c.shards))
    ours = ours_model if ours_model is not None else _ours(path)
    ref = oracle.load_model(path)
    if c.tier == "L2":
        from .oracles import optiq_oracle
        optiq_oracle.install()
    policy = make_policy(ours, kv_bits=c.kv_bits, kv_group_size=c.kv_group_size,
                         quantized_kv_start=c.quantized_kv_start)
    ref_q = oracle.quantizer(c.kv_bits, c.kv_group_size, c.quantized_kv_start)
    return run_schedule(c.name, ours, ours.make_cache(), policy.apply,
                        ref, oracle.make_cache(ref), ref_q,
                        prompt_ids(PROMPT_LENS[c.prompt]), DECODE_STEPS)


def run_generate_check(c: ForwardCheck):
    """Our token loop vs mlx-lm's `generate_step`: tokens and every step's logprobs."""
    from engine.step.stepper import generate_step
    from .oracles import mlx_lm_oracle as oracle

    path = str(ensure_fixture(c.family, c.dtype, c.shards))
    ours = _ours(path)
    ref = oracle.load_model(path)
    kv = {}
    if c.kv_bits:
        if c.tier == "L2":
            from .oracles import optiq_oracle
            optiq_oracle.install()
        kv = dict(kv_bits=c.kv_bits, kv_group_size=c.kv_group_size,
                  quantized_kv_start=c.quantized_kv_start)
    prompt = prompt_ids(PROMPT_LENS[c.prompt])
    expected = oracle.greedy_generate(ref, prompt, DECODE_STEPS, **kv)
    policy = make_policy(ours, kv_bits=c.kv_bits, kv_group_size=c.kv_group_size,
                         quantized_kv_start=c.quantized_kv_start)
    got = list(generate_step(mx.array(prompt), ours, max_tokens=DECODE_STEPS, policy=policy))
    return got, expected
