"""Speculative sampling: the acceptance rule of Leviathan et al. 2023 ("Fast Inference from
Transformers via Speculative Decoding") and Chen et al. 2023 ("Accelerating Large Language
Model Decoding with Speculative Sampling"), the opt-in `spec_sampling="rejection"` of
draft-model speculation (`engine.step.draft`).

With p the target's sampling distribution at a position and q the draft's at the same
position, a draft token x drawn from q is accepted with probability min(1, p(x) / q(x));
at the first rejection the token handed out is drawn from norm(max(0, p - q)) (from p when
that is all zero, i.e. p == q), and the round ends; when all K drafts are accepted one more
token is drawn from the target's distribution after the last of them. Every token handed
out then has the target's sampling distribution given the tokens before it (the theorem of
both papers), and a draft is kept whenever p(x) >= q(x), not only when the target's own
draw happens to equal it (the exact scheme of `engine.step.draft`, mlx-lm's).

p and q are what `engine.step.sampling.make_sampler` draws from: the filters on the
untempered log-probabilities in the sampler's order (top-p, min-p, top-k; XTC, a random
filter, is refused), then softmax(logprobs * (1 / temperature)) in float32
(`sampling_probs`); the same settings for the draft and the target. The draws (the drafts
from q, one uniform per draft, the residual or bonus tokens) come from the global PRNG
(`mx.random.seed(seed)` makes a request repeatable), not the sampler's categorical calls:
the tokens are the target distribution's, not mlx-lm's bits.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from engine.step.sampling import apply_min_p, apply_top_k, apply_top_p

SPEC_SAMPLING = ("exact", "rejection")


def sampling_probs(logprobs: mx.array, settings: dict) -> mx.array:
    """[N, V] float32: the distribution `make_sampler(**settings)` draws from for each row
    of `logprobs` [N, V] (temperature > 0; XTC off)."""
    top_p, min_p, top_k = settings["top_p"], settings["min_p"], settings["top_k"]
    if 0.0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p:
        logprobs = apply_min_p(logprobs, min_p, settings["min_tokens_to_keep"])
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    return mx.softmax((logprobs * (1.0 / settings["temp"])).astype(mx.float32), axis=-1)


def _draw(probs: mx.array, key=None) -> mx.array:
    return mx.random.categorical(mx.log(probs), key=key)


class RejectionRule:
    """The acceptance rule for one sampler's settings: `draw` proposes a draft token (and
    returns q), `verify` decides a round."""

    def __init__(self, settings: dict):
        if settings.get("xtc_probability"):
            raise ValueError("spec_sampling 'rejection' does not take XTC (a random filter: "
                             "its distribution is not one set of probabilities)")
        self.settings = settings

    def draw(self, logprobs: mx.array, key=None):
        """(one draft token [1], its distribution q [1, V]) for the draft's `logprobs` [1, V]
        (`key`: a PRNG key of its own, else the global PRNG)."""
        q = sampling_probs(logprobs, self.settings)
        return _draw(q, key), q

    @staticmethod
    def accepts(px: mx.array, qx: mx.array, key=None) -> mx.array:
        """[K] bool: each draft x kept with probability min(1, p(x) / q(x)) (one uniform
        each; q(x) > 0, x having been drawn from q)."""
        return mx.random.uniform(shape=px.shape, key=key) * qx < px

    @staticmethod
    def residual(p: mx.array, q: mx.array) -> mx.array:
        """[K, V]: what a rejected position draws from, unnormalised: max(0, p - q)."""
        return mx.maximum(p - q, 0.0)

    def verify(self, logprobs: mx.array, draft: mx.array, qs: list, key=None) -> tuple:
        """(tokens, accepted): the target's `logprobs` [K + 1, V] after [last, drafts],
        the K `draft` tokens and their distributions `qs` ([1, V] each). `tokens[:accepted]`
        are the accepted drafts, `tokens[accepted]` the residual (or, all accepted, the bonus)
        draw. One evaluation. `key`: the draws' PRNG key (a batch row's), else the global PRNG."""
        k_accept, k_fix = mx.random.split(key) if key is not None else (None, None)
        k = draft.size
        p = sampling_probs(logprobs, self.settings)                       # [K + 1, V]
        q = mx.concatenate(qs)                                            # [K, V]
        if q.shape[-1] < p.shape[-1]:   # (a draft with fewer embedding rows: q is 0 past them)
            q = mx.pad(q, [(0, 0), (0, p.shape[-1] - q.shape[-1])])
        at = draft.astype(mx.int32)[:, None]
        px = mx.take_along_axis(p[:k], at, axis=-1)[:, 0]
        qx = mx.take_along_axis(q, at, axis=-1)[:, 0]
        accept = self.accepts(px, qx, k_accept)
        resid = self.residual(p[:k], q)
        resid = mx.where(resid.sum(axis=-1, keepdims=True) > 0, resid, p[:k])
        fix = _draw(mx.concatenate([resid, p[k:]]), k_fix)                # [K + 1]
        mx.eval(accept, fix, draft)
        accept, fix, proposed = accept.tolist(), fix.tolist(), draft.tolist()
        ok = 0
        while ok < k and accept[ok]:
            ok += 1
        return proposed[:ok] + [fix[ok]], ok


def rejection_rule(sampler, spec_sampling: str) -> Optional[RejectionRule]:
    """The rule for `sampler` (from `make_sampler`) under `spec_sampling`: None for "exact"
    and for greedy samplers (greedy is the same under both)."""
    if spec_sampling not in SPEC_SAMPLING:
        raise ValueError(f"spec_sampling must be one of {', '.join(SPEC_SAMPLING)}, "
                         f"got {spec_sampling!r}")
    settings = getattr(sampler, "settings", None)
    if spec_sampling == "exact" or not settings or not settings["temp"]:
        return None
    return RejectionRule(settings)
