"""A tool call the token limit cut off: its name and the arguments complete so far.

When a generation stops at its token limit inside tool-call markup, that text is the start of
a call, not the answer's content: shown as text, the template's raw markup (`<tool_call>\\n{"na`)
reads to an agent as the model's reply. OpenAI answers such a cut with `finish_reason: length`
and the call's arguments as far as they got; Anthropic with `stop_reason: max_tokens` and an
incomplete `tool_use` block. `cut_calls` gives the router what it needs to do the same:

- the calls of the markup, the last one cut: its name (checked against the tools, as a whole
  call's is) and only the arguments that were **complete** before the cut. A value the limit
  cut (`"command": "rm -rf /tmp/bu`) is left out, never shortened into a value that looks
  whole; a nested object is kept only once its closing brace came;
- None when not even the name is complete: there is no call to report (the markup is dropped).

How: the markup is cut back to each earlier argument boundary of its format in turn (JSON and
Gemma 4: a `,`; equals-XML: after `</parameter>`; MiniCPM: after `</param>`; then the point
where the arguments open), the format's closing text is added, and the format's own parser
reads it; the first cut that parses wins (for JSON and Gemma 4 the whole markup is tried
first with only the closing marker: a call cut between its last brace and that marker, or
inside the marker). A boundary inside a string or a nested object does
not parse (its string or object stays open), so only top-level boundaries can win.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from engine.text.tools.base import Markers, MarkupError, ToolFormat, ToolIndex

MAX_TRIES = 64          # boundaries tried, latest first (each try parses the markup once)

# (what opens the arguments, the boundaries between arguments, the text that closes the call
# after a boundary), by how the body starts; the first whose opener is found applies
_EQUALS_XML = (re.compile(r"<function=[^\s<>]+\s*>"), "</parameter>", "\n</function>")
_MINICPM = (re.compile(r"<function\s+name\s*=[^>]*>"), "</param>", "</function>")
_JSON = (re.compile(r'"(?:arguments|parameters)"\s*:\s*\{'), ",", "}}")
_GEMMA4 = (re.compile(r"call:[A-Za-z0-9_.\-]+\s*\{"), ",", "}")


def _shape(fmt: ToolFormat, markup: str):
    if fmt.name == "gemma4":
        return _GEMMA4
    if fmt.name == "minicpm5":
        return _MINICPM
    return _EQUALS_XML if "<function=" in markup else _JSON


def _boundaries(markup: str, start: int, sep: str) -> List[int]:
    """Where the markup may be cut back to, latest first: after each separator past `start`
    (the separator itself dropped for `,`, kept for closing tags), then `start`."""
    out, i = [], len(markup)
    while len(out) < MAX_TRIES - 1:
        j = markup.rfind(sep, start, i)
        if j == -1:
            break
        out.append(j if sep == "," else j + len(sep))
        i = j
    return out + [start]


def cut_calls(markup: str, markers: Markers, fmt: ToolFormat,
              index: ToolIndex) -> Optional[List[Tuple[str, Dict[str, Any]]]]:
    """[(name, arguments)] of unterminated `markup` (which opens with `markers[0]`), the last
    call cut short; None when no call's name is complete."""
    opener, sep, closer = _shape(fmt, markup)
    tail = "" if markers[1] == closer.strip() else markers[1]
    heads = list(opener.finditer(markup))
    if not heads:
        return None
    start = heads[-1].end()         # the cut call's arguments open here
    # (JSON, Gemma 4: the call whole but its closing marker first; a brace-delimited value
    # cut short cannot close its braces there. XML values have no such guard: not tried)
    whole = markup
    for k in range(len(markers[1]) - 1, 0, -1):     # (the closing marker itself cut short)
        if whole.endswith(markers[1][:k]):
            whole = whole[:-k]
            break
    tries = [whole + tail] if sep == "," else []
    tries += [markup[:cut] + closer + tail for cut in _boundaries(markup, start, sep)]
    for text in tries:
        try:
            calls = fmt.parse(text, index)
        except (MarkupError, ValueError, RecursionError):
            continue
        if calls:
            return calls
    return None
