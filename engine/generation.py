"""`generate` / `stream_generate`: text, token ids or chat messages in; text out.

One request = one `GenerationRequest` (prompt + options). The loop itself is
`engine.stepper.generate_step` (mlx-lm's schedule); this layer adds sampling
settings with generation_config defaults, EOS ids, stop strings matched on
decoded text (never streamed, even in part), streaming detokenization that
never splits a character, logprobs, the prefix prompt cache, KV quantization
and memory admission.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import mlx.core as mx

from .admission import Admission
from .kv_quant import make_policy
from .stepper import generate_step

FALLBACK_SAMPLING = {"temperature": 0.0, "top_p": 0.0, "top_k": 0, "min_p": 0.0}


@dataclass
class Segment:
    """One streamed piece: new text and the tokens that produced it."""
    text: str
    token_ids: list
    logprobs: list = field(default_factory=list)      # per token: {"token", "logprob", "top"}
    finish_reason: Optional[str] = None               # on the last segment: "stop" | "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory_gb: float = 0.0


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


class PromptError(ValueError):
    """The prompt could not be turned into tokens (bad messages, template failure)."""


def encode_prompt(tokenizer, prompt, tools=None, template_kwargs=None) -> list[int]:
    """Text (encoded as-is, adding BOS unless the text already starts with it, like
    `mlx_lm.generate`), a list of token ids, or chat messages (rendered with the
    model's template)."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    if isinstance(prompt, mx.array):
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        if not prompt:
            raise PromptError("messages is empty")
        try:
            return list(tokenizer.apply_chat_template(
                list(prompt), tools=tools, add_generation_prompt=True, **(template_kwargs or {})))
        except Exception as e:  # template errors are the caller's input problem
            raise PromptError(f"chat template failed: {e}") from None
    raise PromptError("prompt must be text, a list of token ids, or a list of chat messages")


def sampling_defaults(tokenizer) -> dict:
    """generation_config.json's sampling fields (temperature, top_p, top_k, min_p)."""
    gc = getattr(tokenizer, "generation_config", None) or {}
    out = dict(FALLBACK_SAMPLING)
    if gc.get("do_sample") is False:
        return out
    for k in out:
        if gc.get(k) is not None:
            out[k] = gc[k]
    return out


def _validate(max_tokens, top_logprobs):
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("max_tokens must be a positive integer")
    if top_logprobs is not None and not 0 <= top_logprobs <= 20:
        raise ValueError("top_logprobs must be between 0 and 20")


def _token_logprob(tok: int, lp: mx.array, top: int) -> dict:
    entry = {"token": tok, "logprob": float(lp[tok].item())}
    if top:
        idx = mx.argpartition(-lp, kth=top - 1)[:top]
        vals = lp[idx]
        order = mx.argsort(-vals)
        entry["top"] = [(int(i), float(v)) for i, v in zip(idx[order].tolist(), vals[order].tolist())]
    return entry


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, list, mx.array],
    *,
    max_tokens: int = 256,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: int = 20,
    presence_penalty: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    logit_bias: Optional[dict] = None,
    seed: Optional[int] = None,
    stop: Optional[Union[str, list]] = None,
    logprobs: bool = False,
    top_logprobs: Optional[int] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    kv_config=None,
    prompt_cache=None,
    cache_namespace: str = "base",
    admission: Optional[Admission] = None,
    tools: Optional[list] = None,
    template_kwargs: Optional[dict] = None,
    prefill_step_size: int = 2048,
    should_stop=None,
    logits_processors: Optional[list] = None,
) -> Iterator[Segment]:
    from .sampling import make_logits_processors, make_sampler
    from .text import StopMatcher

    _validate(max_tokens, top_logprobs)
    ids = encode_prompt(tokenizer, prompt, tools, template_kwargs)
    if not ids:
        raise PromptError("the prompt encodes to no tokens")
    policy = make_policy(model, kv_bits=kv_bits, kv_group_size=kv_group_size,
                         quantized_kv_start=quantized_kv_start, kv_config=kv_config)
    if admission is not None:
        admission.check(len(ids), max_tokens)

    d = sampling_defaults(tokenizer)
    sampler = make_sampler(
        temp=d["temperature"] if temperature is None else temperature,
        top_p=d["top_p"] if top_p is None else top_p,
        min_p=d["min_p"] if min_p is None else min_p,
        top_k=d["top_k"] if top_k is None else top_k,
    )
    processors = make_logits_processors(
        logit_bias=logit_bias, repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
    processors += list(logits_processors or ())   # e.g. engine.constrained's, run last
    if seed is not None:
        mx.random.seed(seed)

    # Prefix reuse: continue from the longest cached prefix of the same namespace.
    caches, reused = None, 0
    if prompt_cache is not None:
        hit = prompt_cache.fetch(cache_namespace, ids)
        if hit is not None:
            caches, reused = hit.caches, hit.reused
            policy.apply(caches)
    if caches is None:
        caches = model.make_cache()

    stops = [stop] if isinstance(stop, str) else list(stop or [])
    matcher = StopMatcher(stops) if stops else None
    # Like mlx-lm's streaming text, drop one space at the very start of the output.
    detok = tokenizer.make_detokenizer(trim_leading_space=True)
    eos = set(tokenizer.eos_token_ids)
    top = top_logprobs or 0
    history = mx.array(ids[:reused]) if reused and processors else None

    tic = time.perf_counter()
    prompt_tps = 0.0
    generated: list[int] = []      # returned to the caller (EOS excluded)
    fed: list[int] = []            # every token the loop produced (each one was fed back)
    pending_ids: list[int] = []
    pending_lp: list = []
    finish = "length"
    n = 0
    held = ""                      # text produced but not yet yielded
    from .cache import RotatingKVCache   # (engine.cache imports the models: not at module level)

    on_prefilled = None
    if prompt_cache is not None and any(isinstance(c, RotatingKVCache) for c in caches):
        # A sliding-window ring that wraps during decoding can no longer be trimmed back
        # to a shared prefix, so the entry stored at the end would only serve prompts
        # that extend the whole conversation. Keep a snapshot at the end of the prompt
        # too (all tokens but the last): a prompt that branches after it still hits.
        def on_prefilled(cs):
            prompt_cache.store(cache_namespace, ids[:len(ids) - 1], cs)
    steps = generate_step(mx.array(ids[reused:]), model, max_tokens=max_tokens, sampler=sampler,
                          logits_processors=processors or None, caches=caches, policy=policy,
                          prefill_step_size=prefill_step_size, history=history,
                          on_prefilled=on_prefilled)

    def segment(text, reason=None):
        nonlocal pending_ids, pending_lp
        elapsed = time.perf_counter() - tic
        seg = Segment(text=text, token_ids=pending_ids, logprobs=pending_lp, finish_reason=reason,
                      prompt_tokens=len(ids), cached_tokens=reused, generation_tokens=n,
                      prompt_tps=prompt_tps, generation_tps=n / elapsed if elapsed > 0 else 0.0,
                      peak_memory_gb=mx.get_peak_memory() / 1e9)
        pending_ids, pending_lp = [], []
        return seg

    try:
        for n, (tok, lp) in enumerate(steps, start=1):
            fed.append(tok)
            if n == 1:
                prompt_tps = (len(ids) - reused) / max(time.perf_counter() - tic, 1e-9)
                tic = time.perf_counter()
            if tok in eos:
                finish = "stop"
                n -= 1
                break
            generated.append(tok)
            pending_ids.append(tok)
            if logprobs or top:
                pending_lp.append(_token_logprob(tok, lp, top))
            detok.add_token(tok)
            text = detok.last_segment
            if matcher is not None:
                text, hit_stop = matcher.feed(text)
                if hit_stop:
                    finish = "stop"
                    yield segment(text, finish)
                    return
            if should_stop is not None and should_stop():
                finish = "cancelled"
                held = text
                break
            if n == max_tokens:
                held = text
                break
            if text:
                yield segment(text)
        detok.finalize()
        tail = detok.last_segment
        hit_stop = False
        if matcher is not None:
            tail, hit_stop = matcher.feed(tail)
        tail = held + tail
        if matcher is not None:
            if hit_stop:
                yield segment(tail, "stop")
                return
            tail += matcher.flush()
        yield segment(tail, finish)
    finally:
        steps.close()
        if prompt_cache is not None:
            tokens = ids + fed
            offset = caches[0].offset if caches else 0
            # the loop is over: the caches are handed to the store, not copied
            prompt_cache.store(cache_namespace, tokens[:offset], caches, copy_caches=False)


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
        generation_tps=last.generation_tps, peak_memory_gb=last.peak_memory_gb)
