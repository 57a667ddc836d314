"""`generate` / `stream_generate`: one request through a one-row `Engine`.

Text, token ids or chat messages in; text out. The options are those of
`engine.SamplingParams` plus the engine's (KV quantization, prompt cache,
admission, prefill chunk). The loop is `engine.step.core.Engine` with
`max_batch=1`, i.e. `engine.step.stepper.generate_step` (mlx-lm's schedule), with
generation_config defaults, EOS ids, stop strings matched on decoded text
(never streamed, even in part), streaming detokenization that never splits a
character, logprobs, the prefix prompt cache and memory admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Union

import mlx.core as mx

from engine.step.admission import Admission
from engine.step.core import Engine
from engine.step.request import (FALLBACK_SAMPLING, PromptError, RequestOutput, SamplingParams,
                      encode_prompt, sampling_defaults)

__all__ = ["FALLBACK_SAMPLING", "GenerationResult", "PromptError", "Segment", "encode_prompt",
           "generate", "sampling_defaults", "stream_generate"]

Segment = RequestOutput     # one streamed piece: new text and the tokens that produced it


@dataclass
class GenerationResult:
    text: str
    token_ids: list
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    logprobs: Optional[list] = None
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory_gb: float = 0.0
    stop_string: Optional[str] = None


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, list, mx.array],
    *,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    kv_config=None,
    prompt_cache=None,
    prefix_caches=None,
    max_kv_size: Optional[int] = None,
    cache_namespace: str = "base",
    admission: Optional[Admission] = None,
    tools: Optional[list] = None,
    template_kwargs: Optional[dict] = None,
    prefill_step_size: int = 2048,
    should_stop=None,
    levers=None,
    logits_processors: Optional[list] = None,
    draft_model=None,
    deterministic: bool = False,
    vision=None,
    **sampling,
) -> Iterator[RequestOutput]:
    """Yield `RequestOutput`s of new text; `sampling` are `SamplingParams` fields
    (max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, logit_bias,
    seed, stop, logprobs, top_logprobs, ...). `should_stop()` is polled after each
    token; when true the request ends with finish_reason "cancelled".
    `logits_processors`: processor objects for this one request (e.g.
    engine.constrained's), run after the built-in ones; to build them per request
    instead, pass `processor_factories`. `prefix_caches`: per-layer caches already holding
    the context before `prompt` (`engine.kv.cache_file.load_prompt_cache`). `max_kv_size`:
    keep at most this many tokens in each full-attention layer's cache (mlx-lm's ring).
    `draft_model`: a model with the same vocabulary that drafts `num_draft_tokens` tokens a
    step for speculative decoding (`engine.step.draft`; `engine.step.draft.load_draft`
    loads one and checks its tokenizer).
    `deterministic`: the Engine's deterministic mode (engine.deterministic). `vision`: the
    prompt's images (`engine.vision.vision_prompt` makes the prompt ids and it)."""
    if logits_processors:
        own = tuple((lambda p=p: p) for p in logits_processors)   # this request only
        sampling["processor_factories"] = tuple(sampling.get("processor_factories") or ()) + own
    params = SamplingParams(**sampling)
    eng = Engine(model, tokenizer, max_batch=1, prompt_cache=prompt_cache, admission=admission,
                 kv_bits=kv_bits, kv_group_size=kv_group_size,
                 quantized_kv_start=quantized_kv_start, kv_config=kv_config,
                 prefill_step_size=prefill_step_size, levers=levers, max_kv_size=max_kv_size,
                 draft_model=draft_model, deterministic=deterministic)
    rid = eng.submit(prompt, params, tools=tools, template_kwargs=template_kwargs,
                     cache_namespace=cache_namespace, prefix_caches=prefix_caches,
                     vision=vision)
    try:
        while eng.has_unfinished():
            for out in eng.step():
                if out.error is not None:
                    raise out.error
                yield out
            if should_stop is not None and eng.has_unfinished() and should_stop():
                eng.abort(rid)
    finally:
        eng.abort(rid)         # (closed early: the caches still go to the prompt cache)


def generate(model, tokenizer, prompt, **opts) -> GenerationResult:
    text, ids, lps = [], [], []
    last = None
    for seg in stream_generate(model, tokenizer, prompt, **opts):
        text.append(seg.text)
        ids.extend(seg.token_ids)
        lps.extend(seg.logprobs)
        last = seg
    want_lp = opts.get("logprobs") or opts.get("top_logprobs")
    return GenerationResult(
        text="".join(text), token_ids=ids, finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens, cached_tokens=last.cached_tokens,
        logprobs=lps if want_lp else None, prompt_tps=last.prompt_tps,
        generation_tps=last.generation_tps, peak_memory_gb=last.peak_memory_gb,
        stop_string=last.stop_string)
