"""The streaming tool-call router and its one-shot twin.

``ToolCallRouter.feed(delta)`` splits generated text into ``ContentDelta`` and
``ToolCall`` events as it arrives:

- outside markup, text is emitted at once, except a tail that could be the
  start of an opening marker (``"<tool"`` could become ``"<tool_call>"``),
  which is held until the next delta settles it, like a stop-string matcher;
- from an opening marker on, text is withheld until the format's closing
  marker (found by the format's ``scan``: MiniCPM skips CDATA sections);
  if the same opening marker appears again first, the earlier one was not
  markup and the text up to the new one is content;
- a complete markup that parses becomes one ``ToolCall`` per call in it; one
  that does not parse (bad syntax, unknown tool name when tools are given) is
  emitted as content, verbatim;
- ``finish()`` releases whatever is held: a held tail, or unterminated markup,
  as content; ``finish(cut=True)`` (the text ended at the token limit) reads
  unterminated markup as a call the limit cut: its calls, the last with
  ``cut=True`` and only its complete arguments (``engine.text.tools.cut``), or
  nothing when not even the name was complete; never the raw markup as content
  (nor a held tail that could start a marker: ``<tool_ca``).

Every decision is made only on text that is fully present, so the events do
not depend on how the text was chunked: ``parse_tool_calls(text)`` (which
feeds the whole text at once) gives the same content and calls as any
chunking. Content is verbatim: whitespace around calls is kept (strip it in
the server if you want).
"""

from __future__ import annotations

import uuid
from typing import Callable, List, Optional, Sequence, Tuple, Union

from engine.text.tools.base import (ContentDelta, Event, Markers, MarkupError, StreamSplitter, ToolCall, ToolFormat,
                   ToolIndex, dumps_arguments)
from engine.text.tools.cut import cut_calls
from engine.text.tools.formats import get_tool_format


def new_call_id() -> str:
    """``call_`` + 24 random hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallRouter(StreamSplitter):
    """Route streamed text into content and tool calls for one ``format``.

    ``format``: a ``ToolFormat``, a format/family name (``get_tool_format``),
    or None for pass-through (everything is content). ``tools``: OpenAI
    function tools; names are checked and arguments decoded against their
    schemas; None or ``[]`` accepts any name with no schema. ``id_factory``
    makes call ids (default ``new_call_id``).
    """

    def __init__(self, format: Union[ToolFormat, str, None], tools: Optional[Sequence[dict]] = None,
                 *, id_factory: Optional[Callable[[], str]] = None):
        super().__init__()
        if isinstance(format, str):
            format = get_tool_format(format)
        self.format: Optional[ToolFormat] = format
        self.index = ToolIndex(tools)
        self._new_id = id_factory or new_call_id
        self._markers: Tuple[Markers, ...] = format.markers if format else ()
        self._longest_open = max((len(o) for o, _ in self._markers), default=0)
        self._inside: Optional[Markers] = None  # the markers of the markup being withheld
        self._cut = False                # finish(cut=True): the token limit ended the text
        self.calls: List[ToolCall] = []  # every call emitted so far

    @property
    def pending(self) -> str:
        """Text received but not yet emitted (a held tail or open markup)."""
        return self._buf

    @property
    def in_tool_call(self) -> bool:
        """True while an opening marker has been seen and its markup is withheld."""
        return self._inside is not None

    def finish(self, cut: bool = False) -> List[Event]:
        """Release what is held; `cut`: the text ended at the token limit, so unterminated
        markup is a call cut short (see the module's docstring), not content."""
        self._cut = cut
        return super().finish()

    # -- internals ---------------------------------------------------------

    def _first_open(self, buf: str) -> Tuple[int, Optional[Markers]]:
        best, which = -1, None
        for pair in self._markers:
            j = buf.find(pair[0])
            if j != -1 and (best == -1 or j < best):
                best, which = j, pair
        return best, which

    def _held_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that a marker could start with."""
        for k in range(min(len(buf), self._longest_open - 1), 0, -1):
            tail = buf[-k:]
            if any(o.startswith(tail) for o, _ in self._markers):
                return k
        return 0

    def _drain(self, final: bool) -> List[Event]:
        out: List[Event] = []
        text: List[str] = []

        def flush():
            if text:
                joined = "".join(text)
                text.clear()
                if joined:
                    out.append(ContentDelta(joined))

        buf = self._buf
        while buf:
            if self._inside is None:
                j, pair = self._first_open(buf)
                if pair is None:     # (on a cut, a tail that could start a marker is dropped)
                    keep = 0 if final and not self._cut else self._held_tail(buf)
                    text.append(buf[:len(buf) - keep])
                    buf = "" if final else buf[len(buf) - keep:]
                    break
                text.append(buf[:j])
                buf, self._inside = buf[j:], pair
                continue
            found = self.format.scan(buf, self._inside)
            if found is None:
                if final and self._cut:     # a call the token limit cut: never content
                    flush()
                    out += self._cut_calls(buf)
                    buf, self._inside = "", None
                elif final:  # unterminated markup is content
                    text.append(buf)
                    buf, self._inside = "", None
                break
            kind, j = found
            if kind == "reopen":
                text.append(buf[:j])
                buf = buf[j:]
                continue
            markup, buf, self._inside = buf[:j], buf[j:], None
            try:
                parsed = self.format.parse(markup, self.index)
            except (MarkupError, ValueError, RecursionError):
                text.append(markup)
                continue
            flush()
            out += self._calls(parsed, markup)
        self._buf = buf
        flush()
        return out

    def _calls(self, parsed, markup: str, cut: bool = False) -> List[ToolCall]:
        last = len(parsed) - 1
        # (a cut call's arguments_json is its complete arguments' JSON left open: it does not
        # parse, as a truncated call's arguments do not from OpenAI or Anthropic, so a client
        # that runs whatever parses does not run it; `arguments` holds them as an object)
        calls = [ToolCall(self._new_id(), name, args,
                          dumps_arguments(args)[:-1] if cut and i == last else dumps_arguments(args),
                          markup, cut=cut and i == last)
                 for i, (name, args) in enumerate(parsed)]
        self.calls += calls
        return calls

    def _cut_calls(self, markup: str) -> List[ToolCall]:
        parsed = cut_calls(markup, self._inside, self.format, self.index)
        return self._calls(parsed, markup, cut=True) if parsed else []


def parse_tool_calls(text: str, format: Union[ToolFormat, str, None],
                     tools: Optional[Sequence[dict]] = None, *,
                     id_factory: Optional[Callable[[], str]] = None) -> Tuple[str, List[ToolCall]]:
    """Non-streaming: ``(content, calls)`` for a whole generated text, exactly
    what a ``ToolCallRouter`` fed the same text (in any chunks) produces."""
    router = ToolCallRouter(format, tools, id_factory=id_factory)
    events = router.feed(text) + router.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [e for e in events if isinstance(e, ToolCall)]
