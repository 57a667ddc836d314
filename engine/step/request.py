"""What a request is and what comes back: `SamplingParams`, `RequestOutput`, prompts.

`SamplingParams` holds every generation knob. Values left at None take the
model's `generation_config.json` (sampling fields) or the engine's fallback;
`SamplingParams.resolved(tokenizer)` fills them in. Every value is checked
when the object is made (`ValueError` whose message starts with the field's
name), so a request that reaches the engine's loop cannot fail on its options:
seed in [0, 2**64 - 1], temperature in [0, 2], presence and frequency penalties
in [-2, 2] (`RANGES`), plus what the sampler and processors check.

`RequestOutput` is one piece of a request's output: the text made final since
the previous piece, the tokens behind it (and their logprobs when asked), and
on the last piece the finish reason and, when a stop string ended it, which one.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import mlx.core as mx

from engine.text.stop import TextStream

FALLBACK_SAMPLING = {"temperature": 0.0, "top_p": 0.0, "top_k": 0, "min_p": 0.0}
SEED_MAX = 2 ** 64 - 1            # mx.random.key takes a uint64
# Ranges of a request's sampling values (the OpenAI API's; the sampler functions
# themselves take any temperature, as mlx-lm's do).
RANGES = {"temperature": (0.0, 2.0), "presence_penalty": (-2.0, 2.0),
          "frequency_penalty": (-2.0, 2.0)}


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class PromptError(ValueError):
    """The prompt could not be turned into tokens (bad messages, template failure)."""


class ContextLengthExceeded(PromptError):
    """The prompt leaves no room in the model's context (`max_position_embeddings`):
    refused before anything runs. `prompt_tokens` and `limit` say by how much."""

    def __init__(self, prompt_tokens: int, limit: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens; this model's context is "
                         f"{limit} tokens (prompt plus at least one generated token)")
        self.prompt_tokens, self.limit = prompt_tokens, limit


@dataclass(frozen=True)
class SamplingParams:
    """Generation options of one request (None: the model's default)."""

    max_tokens: int = 256
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens_to_keep: int = 1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: Optional[float] = None
    repetition_context_size: Optional[int] = 20
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    seed: Optional[int] = None
    stop: Union[str, list, tuple, None] = ()
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # Zero-argument callables, each returning a logits processor fn(tokens, logits) ->
    # logits (e.g. engine.constrained's grammar processors, which are stateful). The
    # engine calls every factory once per request it starts and runs the processors
    # after the built-in ones, so one SamplingParams never shares a processor between
    # requests.
    processor_factories: tuple = ()
    # prompt-lookup speculative decoding (engine.step.lookup): draft up to num_draft_tokens
    # tokens from the request's own prompt and output after a match of its last
    # prompt_lookup tokens (0: off); greedy requests without logits processors only
    prompt_lookup: int = 0
    num_draft_tokens: int = 4
    # draft-model speculation (engine.step.draft) when the engine has a draft model: up to
    # num_draft_tokens drafts a step, greedy or sampled, requests without logits processors
    # (False: this request decodes without it)
    use_draft: bool = True
    # how a sampled request keeps drafts (engine.step.rejection): "exact", mlx-lm's scheme
    # (a draft kept when the target's own draw equals it: its bits), or "rejection",
    # speculative sampling (kept with probability min(1, p/q): the target's distribution)
    spec_sampling: Literal["exact", "rejection"] = "exact"

    def __post_init__(self):
        from engine.step.sampling import make_logits_processors, make_sampler

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError("max_tokens must be a positive integer")
        if self.top_logprobs is not None and (
                not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20):
            raise ValueError("top_logprobs must be between 0 and 20")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [0, 2**64 - 1] (what mx.random.key takes), "
                             f"got {self.seed}")
        if not isinstance(self.use_draft, bool):
            raise ValueError(f"use_draft must be true or false, got {self.use_draft!r}")
        if self.spec_sampling not in ("exact", "rejection"):
            raise ValueError(f"spec_sampling must be exact or rejection, got {self.spec_sampling!r}")
        if self.spec_sampling == "rejection" and self.xtc_probability:
            raise ValueError("spec_sampling 'rejection' does not take xtc_probability (XTC is "
                             "a random filter)")
        for name, lo, hi in (("prompt_lookup", 0, 64), ("num_draft_tokens", 1, 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        for name, (lo, hi) in RANGES.items():
            v = getattr(self, name)
            if v is not None and _is_real(v) and not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {v!r}")
        stop = self.stop
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        object.__setattr__(self, "stop", stop)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a dict of token id to bias")
        if self.logit_bias:
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        factories = tuple(self.processor_factories or ())
        if not all(callable(f) for f in factories):
            raise ValueError("processor_factories must be callables that return a processor")
        object.__setattr__(self, "processor_factories", factories)
        s = self._sampler_settings(FALLBACK_SAMPLING)
        try:
            make_sampler(temp=s[0], top_p=s[1], min_p=s[2], top_k=s[3],
                         min_tokens_to_keep=self.min_tokens_to_keep,
                         xtc_probability=self.xtc_probability,
                         xtc_threshold=self.xtc_threshold)
        except ValueError as e:      # the sampler says "temp"; the field is "temperature"
            msg = str(e)
            raise ValueError("temperature" + msg[4:] if msg.startswith("temp ") else msg) from None
        make_logits_processors(**self._processor_kwargs())

    # --- resolution -------------------------------------------------------------

    def resolved(self, tokenizer) -> "SamplingParams":
        """A copy whose sampling fields left at None take the model's defaults."""
        d = sampling_defaults(tokenizer)
        return dataclasses.replace(self, **{k: d[k] for k in d if getattr(self, k) is None})

    def _sampler_settings(self, defaults: dict) -> tuple:
        return tuple(defaults[k] if getattr(self, k) is None else getattr(self, k)
                     for k in ("temperature", "top_p", "min_p", "top_k"))

    def _processor_kwargs(self) -> dict:
        return dict(logit_bias=self.logit_bias, repetition_penalty=self.repetition_penalty,
                    repetition_context_size=self.repetition_context_size,
                    presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty)

    def has_processors(self) -> bool:
        """Whether this request runs logits processors (penalties, bias, grammars)."""
        return bool(self.processor_factories or any(
            v for k, v in self._processor_kwargs().items() if k != "repetition_context_size"))

    def verifiable(self) -> bool:
        """Whether a batch row's verify step can process its later positions as single steps:
        its processors are grammars (structured outputs, forced tool calls:
        `engine.constrained.GrammarFactory`, masks computed ahead) and the built-in penalties
        and logit bias (pure functions of the context), no other factory."""
        return all(getattr(f, "grammar", False) for f in self.processor_factories)

    def looks_up(self, batch_row: bool = False) -> bool:
        """Whether prompt-lookup speculation runs for this (resolved) request: asked for,
        greedy, no logits processors; as a batch row (`batch_row`) sampled too (a draft kept
        when the row's own draw equals it) and with `verifiable` processors."""
        if not self.prompt_lookup:
            return False
        if batch_row:
            return not self.has_processors() or self.verifiable()
        return not self.temperature and not self.has_processors()

    def drafts(self, processors: bool = False) -> bool:
        """Whether this request speculates with the engine's draft model (when it has one):
        not turned off, no prompt lookup, no logits processors (`processors`: `verifiable`
        ones allowed, the batch rows' case); greedy or sampled."""
        return self.use_draft and not self.prompt_lookup and (
            not self.has_processors() or (processors and self.verifiable()))

    def sampler_key(self) -> tuple:
        """What makes two requests' samplers the same (resolved params)."""
        return self._sampler_settings(FALLBACK_SAMPLING) + (
            self.min_tokens_to_keep, self.xtc_probability, self.xtc_threshold)

    def make_sampler(self, special_tokens=()):
        from engine.step.sampling import make_sampler

        t, p, m, k = self._sampler_settings(FALLBACK_SAMPLING)
        return make_sampler(temp=t, top_p=p, min_p=m, top_k=k,
                            min_tokens_to_keep=self.min_tokens_to_keep,
                            xtc_probability=self.xtc_probability,
                            xtc_threshold=self.xtc_threshold,
                            xtc_special_tokens=list(special_tokens) if self.xtc_probability else None)

    def make_processors(self) -> list:
        """This request's processors: the built-in ones, then a fresh one from each
        of `processor_factories` (call once per request)."""
        from engine.step.sampling import make_logits_processors

        procs = make_logits_processors(**self._processor_kwargs())
        return procs + [f() for f in self.processor_factories]

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs or self.top_logprobs)


@dataclass
class RequestOutput:
    """New output of one request since its previous `RequestOutput`."""

    text: str
    token_ids: list
    logprobs: list = field(default_factory=list)      # per token: {"token", "logprob", "top"}
    finish_reason: Optional[str] = None               # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory_gb: float = 0.0
    request_id: Optional[str] = None
    stop_string: Optional[str] = None                 # the stop string that ended it
    error: Optional[BaseException] = None             # finish_reason "error": what was raised
    started: bool = True                              # False: it failed before any token
    logprob_arrays: list = field(default_factory=list)  # [V] per token (keep_logprob_arrays)
    # speculation so far (drafted, accepted, forwards, acceptance); None: it does not speculate
    speculation: Optional[dict] = None
    # where its time to the first token went, once it has one (seconds): waiting (submitted ->
    # it started), lookup (its prefix from the prompt caches: RAM, a disk restore), prefill
    # (the rest of the prompt -> the first token)
    timings: Optional[dict] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


CLIENT_ERRORS: tuple = (ValueError, TypeError, KeyError)


def client_error(out: RequestOutput) -> bool:
    """A failed output whose cause is the request (raised before any token)."""
    return (out.finish_reason == "error" and not out.started
            and isinstance(out.error, CLIENT_ERRORS))


# --- prompts ------------------------------------------------------------------------


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


def token_logprob(tok: int, lp: mx.array, top: int) -> dict:
    """One token's logprob entry: {"token", "logprob"} (+ "top": [(id, logprob)] best first)."""
    entry = {"token": tok, "logprob": float(lp[tok].item())}
    if top:
        idx = mx.argpartition(-lp, kth=top - 1)[:top]
        vals = lp[idx]
        order = mx.argsort(-vals)
        entry["top"] = [(int(i), float(v)) for i, v in zip(idx[order].tolist(), vals[order].tolist())]
    return entry


def model_context(model) -> Optional[int]:
    """The model's context length (`max_position_embeddings`, or its text config's)."""
    args = getattr(model, "args", None)
    for a in (args, getattr(args, "text_config", None)):
        n = a.get("max_position_embeddings") if isinstance(a, dict) else getattr(
            a, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def model_vocab_size(model) -> Optional[int]:
    """Rows of the model's token embedding (`vocab_size`, or its text config's)."""
    args = getattr(model, "args", None)
    for a in (args, getattr(args, "text_config", None)):
        n = a.get("vocab_size") if isinstance(a, dict) else getattr(a, "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def check_token_ids(ids: list, vocab_size: Optional[int]) -> None:
    """Raise `PromptError` (a ValueError) naming the first id outside [0, vocab_size):
    the embedding gather does not check its indices."""
    if not ids or not vocab_size:
        return
    if 0 <= min(ids) and max(ids) < vocab_size:
        return
    bad = next(t for t in ids if not 0 <= t < vocab_size)
    raise PromptError(f"prompt token id {bad} is outside the vocabulary (size {vocab_size})")


class RequestState:
    """One submitted request's state inside `engine.step.core.Engine`, whichever lane runs it."""

    def __init__(self, rid, ids, params, adapters, ns, lane, tokenizer):
        self.rid, self.ids, self.params, self.adapters, self.ns = rid, ids, params, adapters, ns
        self.lane = lane                  # "batch" | "solo"
        self.need = len(ids) + params.max_tokens
        self.reused = 0
        self.fed: list = []               # every token sampled (each one fed back)
        self.n = 0                        # tokens returned (EOS excluded)
        self.pending_ids: list = []
        self.pending_lp: list = []
        self.pending_arrays: list = []
        self.tic = self.submitted = time.perf_counter()
        self.lookup_at: Optional[tuple] = None    # (start, end) of its prefix lookup
        self.first_at: Optional[float] = None     # when its first token came
        self._timings: Optional[dict] = None      # `timings()`, once made
        self.prompt_tps = 0.0
        self.top = params.top_logprobs or 0
        self.prefix = None                # solo: caches holding the context before `ids`
        self.uid: Optional[int] = None    # batch row id
        self.steps = None                 # solo: the generate_step iterator (once prefilled)
        self.caches = None                # solo: its caches
        self.prompt = None                # solo: the uncached prompt tokens, prefilling
        self.done = 0                     # solo: how many of them are in the caches
        self.vision = None                # its images (engine.vision.VisionInput), if any
        self.embeds = None                # solo: the uncached prompt's embeddings (images)
        self.whole = False                # solo: its prompt in one forward, no prompt cache
        self.start_decode = None          # solo: builds `steps` once prefilled
        self.spec = None                  # solo: its SpecStats while it speculates
        self.text = TextStream(tokenizer, params.stop)   # (the one update's, every runner)

    def timings(self) -> Optional[dict]:
        """RequestOutput.timings: None before the first token (made once: every output after
        it hands on the same dict)."""
        if self.first_at is None or self._timings is not None:
            return self._timings
        start, end = self.lookup_at or (self.submitted, self.submitted)
        self._timings = {"waiting_s": start - self.submitted, "lookup_s": end - start,
                         "prefill_s": self.first_at - end}
        return self._timings

    def output(self, text: str, reason=None, **kw) -> RequestOutput:
        now = time.perf_counter()
        out = RequestOutput(text=text, token_ids=self.pending_ids, logprobs=self.pending_lp,
                            finish_reason=reason, prompt_tokens=len(self.ids),
                            cached_tokens=self.reused, generation_tokens=self.n,
                            prompt_tps=self.prompt_tps,
                            generation_tps=self.n / (now - self.tic) if now > self.tic else 0.0,
                            peak_memory_gb=mx.get_peak_memory() / 1e9, request_id=self.rid,
                            started=bool(self.fed), logprob_arrays=self.pending_arrays,
                            speculation=self.spec.as_dict() if self.spec is not None else None,
                            timings=self.timings(), **kw)
        self.pending_ids, self.pending_lp, self.pending_arrays = [], [], []
        return out
