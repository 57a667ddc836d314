"""A protocol-neutral request (`Call`) and what the engine takes from it: sampling
parameters, the prompt's token ids, the most it may generate.

The protocol modules (openai, anthropic, responses) fill a `Call` from their wire format
(`sampling_from`, `template_kwargs_from`); `server.chat.start` turns it into the engine's
request (`sampling_params`, `encode_async`, `uncapped` / `context_left`) and queues it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import bad_request
from .messages import check_logit_bias


@dataclass
class Call:
    """A protocol-neutral generation request."""
    messages: Optional[list] = None        # chat messages (template applied), or
    prompt: Any = None                     # raw text / token ids (no template)
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    repetition_context_size: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    seed: Optional[int] = None
    spec_sampling: Optional[str] = None    # "exact" | "rejection" (None: the server's)
    stop: list = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    tools: Optional[list] = None           # OpenAI function tools (None = no tools)
    template_kwargs: dict = field(default_factory=dict)
    adapter: Any = "__default__"           # request's adapter field ("__default__" = absent)
    response_format: Any = None            # engine.constrained.ResponseFormat (constraints.py)
    tool_choice: Any = None                # engine.constrained.ToolChoice
    format_param: str = "response_format"  # the request field the format came from
    parallel_tool_calls: bool = True
    images: list = field(default_factory=list)   # server.images.ImageRef, in message order
    vision: Any = None                     # engine.VisionInput (set by `encode`)


def sampling_from(req, call: Call, state) -> None:
    """The sampling fields every protocol shares, from the validated request model
    (`server.schemas.common.SamplingFields`: types and ranges checked; None = absent)."""
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "repetition_context_size", "presence_penalty", "frequency_penalty", "seed",
                 "spec_sampling"):
        setattr(call, name, getattr(req, name))   # seed's range: engine.SamplingParams
    call.logit_bias = check_logit_bias(req.logit_bias, state.vocab_size)
    if "adapter" in req.model_fields_set:
        call.adapter = req.adapter
    elif req.adapters is not None:
        call.adapter = req.adapters


def template_kwargs_from(req, state) -> dict:
    kw = dict(state.config.template_kwargs)
    if state.config.thinking is not None:
        kw["enable_thinking"] = state.config.thinking
    elif "enable_thinking" not in kw:
        from engine import default_enable_thinking
        default = default_enable_thinking(state.tokenizer)   # MiniCPM5: off unless asked
        if default is not None:
            kw["enable_thinking"] = default
    effort = req.reasoning_effort
    if isinstance(effort, str):
        kw["enable_thinking"] = effort.lower() != "none"
    if req.chat_template_kwargs:
        kw.update(req.chat_template_kwargs)
    return kw


def sampling_params(state, call: Call, factories: tuple = ()):
    """The request's `engine.SamplingParams` (server defaults for absent fields);
    a bad value is a 400 before anything is queued. `factories`: the grammar
    processors (`constraints.compile_factories`, compiled after the other checks)."""
    from engine import SamplingParams

    cfg = state.config

    def pick(v, default):
        return v if v is not None else default
    kw = {}
    if call.repetition_context_size is not None:
        kw["repetition_context_size"] = call.repetition_context_size
    try:
        return SamplingParams(
            max_tokens=pick(call.max_tokens, cfg.max_tokens) or 1,   # uncapped: set in start()
            temperature=pick(call.temperature, cfg.temperature),
            top_p=pick(call.top_p, cfg.top_p), top_k=pick(call.top_k, cfg.top_k),
            min_p=pick(call.min_p, cfg.min_p), repetition_penalty=call.repetition_penalty,
            presence_penalty=call.presence_penalty, frequency_penalty=call.frequency_penalty,
            logit_bias=call.logit_bias, seed=call.seed, stop=list(call.stop),
            logprobs=bool(call.logprobs or call.top_logprobs),
            top_logprobs=call.top_logprobs or None,
            processor_factories=factories, prompt_lookup=cfg.prompt_lookup,
            num_draft_tokens=cfg.num_draft_tokens,
            spec_sampling=pick(call.spec_sampling, cfg.spec_sampling), **kw)
    except ValueError as e:          # the message starts with the field's name
        msg = str(e)
        param = msg.split(" ", 1)[0]
        raise bad_request(msg, param=param if param in _PARAM_FIELDS else None) from None


_PARAM_FIELDS = frozenset(("max_tokens", "top_logprobs", "temperature", "top_p", "top_k", "min_p",
                           "repetition_penalty", "repetition_context_size", "presence_penalty",
                           "frequency_penalty", "logit_bias", "seed", "stop",
                           "spec_sampling"))


def uncapped(state, call: Call) -> bool:
    """No max tokens from the request nor the server (`--max-tokens`): run to the context
    limit, as OpenAI and Anthropic do."""
    return call.max_tokens is None and state.config.max_tokens is None


def context_left(state, prompt_tokens: int) -> int:
    """Tokens a request of this prompt may generate at most: the model's context left,
    bounded by memory admission (at least 1, so an over-long prompt still gets the
    context or admission error)."""
    limit = state.admission.max_context()
    ctx = state.engine.max_context
    if ctx is not None:
        limit = min(limit, ctx)
    return max(1, limit - prompt_tokens)


def encode(state, call: Call) -> list:
    from engine import PromptError, check_token_ids, encode_prompt

    if call.images:        # (the images fetched, decoded and preprocessed: engine.vision)
        from .images import vision_encode
        ids, call.vision = vision_encode(state, call)
        return ids
    try:
        if call.messages is not None:
            ids = encode_prompt(state.tokenizer, call.messages, call.tools, call.template_kwargs)
        else:
            ids = encode_prompt(state.tokenizer, call.prompt)
    except PromptError as e:
        raise bad_request(f"prompt build failed: {e}") from None
    except (TypeError, ValueError) as e:
        raise bad_request(f"prompt build failed: {e}") from None
    if not ids:
        raise bad_request("the prompt encodes to no tokens")
    try:
        check_token_ids(ids, state.vocab_size)
    except PromptError as e:
        raise bad_request(str(e)) from None
    return ids


INLINE_ENCODE_CHARS = 8192


async def encode_async(state, call: Call) -> list:
    """`encode` without stalling the event loop: a long prompt or one with images on a thread
    (a short one inline: the thread hand-off and back costs more than the encode: TTFT); image
    URLs fetched first on the image-URL pool (`server.images.fetch_urls`), so slow URLs never
    hold the threads other requests encode on."""
    if call.images:
        from .images import fetch_urls
        await fetch_urls(call.images, state.config)
    if _input_chars(call) <= INLINE_ENCODE_CHARS and not call.images:
        return encode(state, call)
    return await asyncio.to_thread(encode, state, call)


def _input_chars(call: Call) -> int:
    if call.messages is None:
        return len(call.prompt) if isinstance(call.prompt, (str, list)) else 0
    n = sum(len(m.get("content") or "") + 64 * len(m.get("tool_calls") or ())
            for m in call.messages)
    return n + (256 * len(call.tools) if call.tools else 0)
