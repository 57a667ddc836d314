"""Run the same schedule on two engines and compare every logits tensor bit for bit.

The schedule mirrors mlx-lm's `generate_step`: prefill `prompt[:-1]` in one
forward, run the cache policy, then feed the last prompt token and `steps`
greedy tokens one at a time, running the policy after every forward. Greedy
tokens come from the oracle side, so both engines see the same inputs even if
they were to disagree (the comparison then shows at which step and by how much).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class StepDiff:
    step: int            # -1 = prefill, then 0.. decode steps
    shape: tuple
    equal: bool
    max_abs_diff: float


@dataclass
class Comparison:
    name: str
    steps: list = field(default_factory=list)
    tokens_ours: list = field(default_factory=list)
    tokens_ref: list = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(s.equal for s in self.steps) and self.tokens_ours == self.tokens_ref

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.steps), default=0.0)

    def first_mismatch(self):
        return next((s for s in self.steps if not s.equal), None)

    def summary(self) -> dict:
        bad = self.first_mismatch()
        return {"name": self.name, "equal": self.equal, "checks": len(self.steps),
                "shape": list(self.steps[0].shape) if self.steps else None,
                "max_abs_diff": self.max_abs_diff,
                "first_mismatch_step": None if bad is None else bad.step,
                "tokens_equal": self.tokens_ours == self.tokens_ref}


def _diff(a: mx.array, b: mx.array, step: int) -> StepDiff:
    if a.shape != b.shape:
        return StepDiff(step, tuple(a.shape), False, float("inf"))
    eq = bool(mx.array_equal(a, b).item())
    d = 0.0 if eq else float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())
    return StepDiff(step, tuple(a.shape), eq, d)


def run_schedule(name, ours, ours_cache, ours_policy, ref, ref_cache, ref_policy,
                 prompt, steps: int) -> Comparison:
    """`*_policy(caches)` is each engine's cache-quantization hook (may be a no-op)."""
    cmp = Comparison(name)
    p = mx.array(prompt)[None]
    if p.shape[1] > 1:
        a = ours(p[:, :-1], cache=ours_cache); ours_policy(ours_cache)
        b = ref(p[:, :-1], cache=ref_cache); ref_policy(ref_cache)
        mx.eval(a, b)
        cmp.steps.append(_diff(a, b, -1))
    tok_o = tok_r = p[:, -1:]
    for k in range(steps + 1):
        a = ours(tok_o, cache=ours_cache); ours_policy(ours_cache)
        b = ref(tok_r, cache=ref_cache); ref_policy(ref_cache)
        mx.eval(a, b)
        cmp.steps.append(_diff(a, b, k))
        to, tr = int(mx.argmax(a[0, -1]).item()), int(mx.argmax(b[0, -1]).item())
        cmp.tokens_ours.append(to)
        cmp.tokens_ref.append(tr)
        tok_o = tok_r = mx.array([[tr]])
    return cmp
