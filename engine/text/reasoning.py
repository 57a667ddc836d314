"""Reasoning separation: split generated text into reasoning and content.

Thinking families wrap their reasoning in markers:

=============  ========================  ===============  =========================
family         reasoning opens with      closes with      thinking switch (template)
=============  ========================  ===============  =========================
``qwen3``      ``<think>``               ``</think>``     on unless ``enable_thinking=False``
``minicpm5``   ``<think>``               ``</think>``     off unless ``enable_thinking=True``
``gemma4``     ``<|channel>thought``     ``<channel|>``   off unless ``enable_thinking=True``
=============  ========================  ===============  =========================

When the generation prompt itself opens a reasoning block (MiniCPM5 with
thinking on ends the prompt with ``<think>\\n``), the output starts inside
reasoning: ``starts_in_reasoning(prompt_text, fmt)`` says so, the way
mlx-lm's server decides it (the last opening marker comes after the last
closing one). A prompt that closes an empty block (thinking off) starts in
content.

``ReasoningSplitter.feed(delta)`` turns streamed text into ``ReasoningDelta``
and ``ContentDelta`` events. It decides only on text that is fully present (a
tail that could begin a marker is held until the next delta), so the events,
joined, do not depend on how the text was chunked; ``split_reasoning(text)``
feeds the whole text at once and gives the same result. With ``strip=True``
(the default) whitespace right inside a reasoning block and right after its
closing marker is dropped (``<think>\\nA\\n</think>\\n\\nB`` gives reasoning
``A`` and content ``B``), as the templates do when they render the reasoning
back; everything else is verbatim.

``ChatOutputParser`` composes the splitter with a tool-call router: content
goes through ``engine.text.tools.ToolCallRouter``; text inside reasoning is never
parsed for tool calls.

Markers are text, so the detokenizer must keep special tokens (MiniCPM5's
``<think>`` and Gemma 4's channel markers are special tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Union

from engine.text.tools import ContentDelta, ToolCall, ToolCallRouter, ToolFormat
from engine.text.tools.base import StreamSplitter

__all__ = [
    "ReasoningFormat", "ReasoningDelta", "REASONING_FORMATS", "get_reasoning_format",
    "reasoning_format_for", "default_enable_thinking", "starts_in_reasoning", "ReasoningSplitter", "split_reasoning",
    "ChatOutputParser", "ParsedOutput", "parse_chat_output",
]


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's reasoning markers (text, as the detokenizer writes them)."""

    name: str
    start: str
    end: str

    def __post_init__(self):
        if not self.start or not self.end:
            raise ValueError("reasoning markers must be non-empty")


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text, to stream as ``delta.reasoning_content`` / a thinking block."""

    text: str


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>"),
    "minicpm5": ReasoningFormat("minicpm5", "<think>", "</think>"),
    "gemma4": ReasoningFormat("gemma4", "<|channel>thought", "<channel|>"),
}
# model_type / family prefixes -> format (first match wins)
_FAMILIES = (("gemma4", "gemma4"), ("minicpm", "minicpm5"), ("qwen3", "qwen3"))


def get_reasoning_format(family_or_model_type: Union[str, ReasoningFormat]) -> ReasoningFormat:
    """The reasoning format of a family name or config ``model_type``
    (``gemma4*`` -> gemma4, ``minicpm*`` -> minicpm5, ``qwen3*`` -> qwen3).
    ValueError for a family that does not think (e.g. llama, qwen2)."""
    if isinstance(family_or_model_type, ReasoningFormat):
        return family_or_model_type
    if not isinstance(family_or_model_type, str):
        raise ValueError(f"expected a model_type or family name, got {family_or_model_type!r}")
    key = family_or_model_type.strip().lower().replace("-", "_")
    for prefix, name in _FAMILIES:
        if key.startswith(prefix):
            return REASONING_FORMATS[name]
    raise ValueError(f"no reasoning format for {family_or_model_type!r}; "
                     f"formats: {', '.join(REASONING_FORMATS)}")


def reasoning_format_for(tokenizer: Any) -> Optional[ReasoningFormat]:
    """The reasoning format a loaded ``engine.text.tokenizer.Tokenizer`` calls for,
    from its vocabulary and chat template (as the tool parser is chosen), not
    from ``model_type``: None when the tokenizer has no thinking markers.
    A MiniCPM5 checkpoint (``model_type: llama``) is recognised by its template."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if not start or not end:
        return None
    for fmt in REASONING_FORMATS.values():
        if (fmt.start, fmt.end) == (start, end):
            if fmt.name in ("qwen3", "minicpm5"):
                name = "minicpm5" if getattr(tokenizer, "tool_parser_type", None) == "minicpm5" \
                    else "qwen3"
                return REASONING_FORMATS[name]
            return fmt
    return ReasoningFormat("think", start, end)


def default_enable_thinking(tokenizer: Any) -> Optional[bool]:
    """The ``enable_thinking`` a server should render with when neither the
    request nor the server's settings say: False for MiniCPM5 (it answers
    directly unless asked to think), None (the tokenizer's own default,
    ``has_thinking`` as in mlx-lm) for every other family."""
    fmt = reasoning_format_for(tokenizer)
    return False if fmt is not None and fmt.name == "minicpm5" else None


def starts_in_reasoning(prompt_text: str, fmt: Union[str, ReasoningFormat, None]) -> bool:
    """True when the prompt leaves a reasoning block open (its last opening
    marker comes after its last closing marker)."""
    if fmt is None:
        return False
    fmt = get_reasoning_format(fmt)
    return prompt_text.rfind(fmt.start) > prompt_text.rfind(fmt.end)


def _held_tail(buf: str, marker: str) -> int:
    """Length of the longest tail of ``buf`` that ``marker`` could start with."""
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0


Event = Union[ReasoningDelta, ContentDelta]


class ReasoningSplitter(StreamSplitter):
    """Split streamed text into ``ReasoningDelta`` / ``ContentDelta`` events.

    ``fmt``: a ``ReasoningFormat`` or family name; ``in_reasoning``: the
    output starts inside a reasoning block (see ``starts_in_reasoning``).
    Any number of blocks may occur; each opening marker switches to
    reasoning, each closing marker back to content.
    """

    def __init__(self, fmt: Union[str, ReasoningFormat], *, in_reasoning: bool = False,
                 strip: bool = True):
        super().__init__()
        self.format = get_reasoning_format(fmt)
        self.in_reasoning = bool(in_reasoning)
        self.strip = strip
        self._lead = self.in_reasoning   # drop whitespace at the start of this segment

    def _drain(self, final: bool) -> List[Event]:
        out: List[Event] = []

        def emit(text: str):
            if not text:
                return
            self._lead = False
            kind = ReasoningDelta if self.in_reasoning else ContentDelta
            if out and isinstance(out[-1], kind):
                out[-1] = kind(out[-1].text + text)
            else:
                out.append(kind(text))

        buf = self._buf
        while buf:
            if self._lead and self.strip:
                buf = buf.lstrip()
                if not buf:
                    break
            marker = self.format.end if self.in_reasoning else self.format.start
            j = buf.find(marker)
            if j == -1:
                keep = 0 if final else _held_tail(buf, marker)
                text = buf[:len(buf) - keep]
                if self.in_reasoning and self.strip:
                    # trailing whitespace waits: it is dropped if the block closes next
                    body = text.rstrip()
                    if not final:
                        keep += len(text) - len(body)
                    text = body
                emit(text)
                buf = buf[len(buf) - keep:]
                break
            seg = buf[:j]
            emit(seg.rstrip() if self.in_reasoning and self.strip else seg)
            buf = buf[j + len(marker):]
            self.in_reasoning = not self.in_reasoning
            self._lead = True
        self._buf = buf
        return out


def split_reasoning(text: str, fmt: Union[str, ReasoningFormat], *, in_reasoning: bool = False,
                    strip: bool = True) -> tuple:
    """Non-streaming: ``(reasoning, content)`` of a whole text, exactly what a
    ``ReasoningSplitter`` fed the same text in any chunks produces, joined."""
    s = ReasoningSplitter(fmt, in_reasoning=in_reasoning, strip=strip)
    events = s.feed(text) + s.finish()
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, ContentDelta)))


@dataclass
class ParsedOutput:
    """A whole generated message: reasoning, content and tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    """Reasoning splitter -> tool-call router, streaming.

    ``reasoning``: a reasoning format (or None: the model does not think);
    ``tool_format``: a tool format (or None: no tool parsing). Events are
    ``ReasoningDelta``, ``ContentDelta`` and ``ToolCall``. Tool calls are only
    read from content, never from inside reasoning.
    """

    def __init__(self, reasoning: Union[str, ReasoningFormat, None] = None,
                 tool_format: Union[str, ToolFormat, None] = None,
                 tools: Optional[Sequence[dict]] = None, *, in_reasoning: bool = False,
                 strip: bool = True, id_factory: Optional[Callable[[], str]] = None):
        self.splitter = (ReasoningSplitter(reasoning, in_reasoning=in_reasoning, strip=strip)
                         if reasoning is not None else None)
        self.router = ToolCallRouter(tool_format, tools, id_factory=id_factory)

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far leaves the output inside a reasoning block."""
        return self.splitter is not None and self.splitter.in_reasoning

    def _route(self, events: List[Event], final: bool, cut: bool = False) -> list:
        out: list = []
        for e in events:
            out += self.router.feed(e.text) if isinstance(e, ContentDelta) else [e]
        if final:
            out += self.router.finish(cut=cut)
        return out

    def feed(self, text: str) -> list:
        if self.splitter is None:
            return self.router.feed(text)
        return self._route(self.splitter.feed(text), final=False)

    def finish(self, cut: bool = False) -> list:
        """The held events; `cut`: the text ended at the token limit (a tool call it cut is
        a cut call, never content: ToolCallRouter.finish)."""
        if self.splitter is None:
            return self.router.finish(cut=cut)
        return self._route(self.splitter.finish(), final=True, cut=cut)


def collect(events: list) -> ParsedOutput:
    """Join a stream of events into one ``ParsedOutput``."""
    return ParsedOutput(
        reasoning="".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        content="".join(e.text for e in events if isinstance(e, ContentDelta)),
        tool_calls=[e for e in events if isinstance(e, ToolCall)])


def parse_chat_output(text: str, reasoning: Union[str, ReasoningFormat, None] = None,
                      tool_format: Union[str, ToolFormat, None] = None,
                      tools: Optional[Sequence[dict]] = None, **kw) -> ParsedOutput:
    """Non-streaming ``ChatOutputParser``: the same result as any chunking."""
    p = ChatOutputParser(reasoning, tool_format, tools, **kw)
    return collect(p.feed(text) + p.finish())
