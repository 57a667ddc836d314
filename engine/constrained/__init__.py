"""Constrained decoding: structured outputs and enforced tool calls.

    from engine.constrained import (parse_response_format, parse_tool_choice,
                                    response_format_processor, tool_choice_processor)

    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": S}})
    proc = response_format_processor(tokenizer, fmt)           # None for {"type": "text"}
    engine.generate(model, tokenizer, prompt, logits_processors=[proc])

    choice = parse_tool_choice({"type": "function", "function": {"name": "f"}}, tools)
    proc = tool_choice_processor(tokenizer, "json_tools", tools, choice)   # None for auto/none

Through the engine (either lane; one fresh processor per request):

    make = response_format_factory(tokenizer, fmt)             # checked now; None for text
    params = engine.SamplingParams(max_tokens=200, processor_factories=(make,))

The grammars are compiled by llguidance (see ``experiments/constrained_overhead.py``
for why: the lowest per-token mask time of the libraries that install on this
platform without torch, JSON Schema, Lark and special tokens in one engine);
the processor is an ordinary logits processor, so it works in the serial loop
and per row in ``BatchScheduler``. Bad requests raise ``ConstraintError`` (a
``ValueError`` that carries the request ``param`` to name in a 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from engine.text.reasoning import ReasoningFormat, get_reasoning_format
from .checks import DEFAULT_MAX_SCHEMA_NODES, check_schema, check_tool_names
from .grammars import Literals, json_grammar, reasoning_prefix, tool_call_grammar
from .processor import (GrammarDeadEnd, GrammarProcessor, compile_grammar, compile_matcher,
                        ll_tokenizer)

__all__ = [
    "ConstraintError", "ResponseFormat", "ToolChoice", "parse_response_format",
    "parse_tool_choice", "response_format_processor", "tool_choice_processor",
    "response_format_factory", "tool_choice_factory",
    "GrammarProcessor", "GrammarDeadEnd", "compile_grammar", "compile_matcher", "ll_tokenizer",
    "json_grammar", "tool_call_grammar", "check_schema", "check_tool_names",
]


class ConstraintError(ValueError):
    """A request field that cannot be honoured; ``param`` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ResponseFormat:
    """``text`` (unconstrained), ``json_object`` or ``json_schema`` (``schema``)."""

    type: str
    schema: Optional[dict] = None
    name: Optional[str] = None
    strict: Optional[bool] = None


@dataclass(frozen=True)
class ToolChoice:
    """``auto``, ``none``, ``required`` (any tool) or ``function`` (``name``)."""

    mode: str
    name: Optional[str] = None

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "function")


def parse_response_format(value: Any, param: str = "response_format") -> Optional[ResponseFormat]:
    """OpenAI chat/completions ``response_format`` or Responses ``text.format``:
    ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`` (chat) or ``{"type":
    "json_schema", "name", "schema", "strict"}`` (Responses). None -> None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConstraintError(f"{param} must be an object", param)
    kind = value.get("type")
    if kind == "text":
        return ResponseFormat("text")
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise ConstraintError(f"{param}.type must be one of 'text', 'json_object', "
                              f"'json_schema'; got {kind!r}", f"{param}.type")
    body = value.get("json_schema", value)
    if not isinstance(body, dict):
        raise ConstraintError(f"{param}.json_schema must be an object", f"{param}.json_schema")
    schema = body.get("schema", {"type": "object"} if "json_schema" in value else None)
    if not isinstance(schema, dict):
        raise ConstraintError(f"{param} needs a JSON schema object in 'schema'", f"{param}.schema")
    name, strict = body.get("name"), body.get("strict")
    if name is not None and not isinstance(name, str):
        raise ConstraintError(f"{param}.name must be a string", f"{param}.name")
    if strict is not None and not isinstance(strict, bool):
        raise ConstraintError(f"{param}.strict must be a boolean", f"{param}.strict")
    return ResponseFormat("json_schema", schema, name, strict)


def _tool_names(tools: Optional[Sequence[dict]]) -> list:
    names = []
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


def parse_tool_choice(value: Any, tools: Optional[Sequence[dict]],
                      param: str = "tool_choice") -> ToolChoice:
    """OpenAI (``"auto" | "none" | "required"``, ``{"type": "function",
    "function": {"name"}}``), Responses (``{"type": "function", "name"}``) and
    Anthropic (``{"type": "auto" | "any" | "tool" | "none", "name"}``) forms.
    None means ``auto`` with tools, ``none`` without. A forced call needs tools,
    and a named tool must be one of them."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        mode, name = {"auto": "auto", "none": "none", "required": "required",
                      "any": "required"}.get(value), None
        if mode is None:
            raise ConstraintError(f"{param} must be 'auto', 'none', 'required' or a function, "
                                  f"got {value!r}", param)
    elif isinstance(value, dict):
        kind = value.get("type")
        if kind in ("auto", "none"):
            mode, name = kind, None
        elif kind == "any":
            mode, name = "required", None
        elif kind in ("function", "tool"):
            fn = value.get("function") if isinstance(value.get("function"), dict) else value
            mode, name = "function", fn.get("name")
            if not isinstance(name, str) or not name:
                raise ConstraintError(f"{param} must name the function to call", param)
        else:
            raise ConstraintError(f"{param}.type {kind!r} is not supported", f"{param}.type")
    else:
        raise ConstraintError(f"{param} must be a string or an object", param)
    if mode in ("required", "function") and not tools:
        raise ConstraintError(f"{param} {mode!r} needs tools", param)
    if mode == "function" and name not in _tool_names(tools):
        raise ConstraintError(f"{param} names {name!r}, which is not among the tools "
                              f"({', '.join(_tool_names(tools))})", param)
    return ToolChoice(mode, name)


def _prefix(tokenizer, reasoning, in_reasoning: bool, budget: Optional[int]):
    if reasoning is None:
        return "", False
    fmt = get_reasoning_format(reasoning) if not isinstance(reasoning, ReasoningFormat) else reasoning
    lit = Literals(tokenizer.added_tokens)
    return reasoning_prefix(None if in_reasoning else fmt.start, fmt.end, lit, budget), in_reasoning


def _specials(tokenizer) -> list:
    """Texts the model writes only as single tokens, which llguidance never takes
    as their text (it treats every added token as special)."""
    lt = ll_tokenizer(tokenizer)
    return [t for i, t in tokenizer.added_tokens.items() if lt.is_special_token(i)]


def response_format_processor(tokenizer, fmt: Optional[ResponseFormat], *,
                              reasoning: Union[str, ReasoningFormat, None] = None,
                              in_reasoning: bool = False,
                              reasoning_budget: Optional[int] = None,
                              max_schema_nodes: int = DEFAULT_MAX_SCHEMA_NODES
                              ) -> Optional[GrammarProcessor]:
    """A processor forcing ``fmt`` (None for ``text``). ``reasoning``: the
    family's reasoning format, to let the model reason first (the JSON starts
    after the block; ``in_reasoning``: the prompt opened it; ``reasoning_budget``
    caps its tokens). ConstraintError for a schema that cannot be honoured
    (``checks.check_schema``: over ``max_schema_nodes`` nodes, not a JSON
    Schema, special-token text, an impossible length) or that llguidance
    cannot compile or finish."""
    if fmt is None or fmt.type == "text":
        return None
    prefix, required = _prefix(tokenizer, reasoning, in_reasoning, reasoning_budget)
    try:
        if fmt.type == "json_schema":
            check_schema(fmt.schema, _specials(tokenizer), where="the schema",
                         max_nodes=max_schema_nodes)
        lark = json_grammar(fmt.schema if fmt.type == "json_schema" else None, prefix,
                            required, strict=fmt.strict is not False)
        return GrammarProcessor(compile_matcher(lark, tokenizer), tokenizer)
    except ValueError as e:
        raise ConstraintError(f"response_format: {e}", "response_format") from None


def tool_choice_processor(tokenizer, tool_format: Any, tools: Optional[Sequence[dict]],
                          choice: ToolChoice, *, parallel: bool = True,
                          reasoning: Union[str, ReasoningFormat, None] = None,
                          in_reasoning: bool = False,
                          reasoning_budget: Optional[int] = None,
                          max_schema_nodes: int = DEFAULT_MAX_SCHEMA_NODES
                          ) -> Optional[GrammarProcessor]:
    """A processor forcing the tool call(s) ``choice`` asks for, in
    ``tool_format`` (a ``ToolFormat`` or its name); None for auto/none. The
    tools' names and parameter schemas are checked as ``response_format_processor``'s
    schema is (``max_schema_nodes``: all the tools' schemas together)."""
    if not choice.forces_call:
        return None
    name = getattr(tool_format, "name", tool_format)
    prefix, required = _prefix(tokenizer, reasoning, in_reasoning, reasoning_budget)
    try:
        fns = [t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict)
               else t for t in tools or []]
        check_tool_names([fn.get("name") if isinstance(fn, dict) else None for fn in fns])
        check_schema({"anyOf": [fn.get("parameters", fn.get("input_schema")) or {}
                                for fn in fns]}, _specials(tokenizer),
                     where="the tools' parameters", max_nodes=max_schema_nodes)
        lark = tool_call_grammar(name, tools or [], choice.name, Literals(tokenizer.added_tokens),
                                 parallel=parallel, prefix=prefix, prefix_required=required)
        return GrammarProcessor(compile_matcher(lark, tokenizer), tokenizer)
    except ValueError as e:
        raise ConstraintError(f"tool_choice: {e}", "tool_choice") from None


class GrammarFactory:
    """A fresh `GrammarProcessor` of one compiled grammar per call (per request); marked
    `grammar` so that speculation knows its masks can be computed ahead
    (`SamplingParams.verifiable`, `GrammarProcessor.masks_ahead`)."""

    grammar = True

    def __init__(self, grammar, tokenizer):
        self._grammar, self._tokenizer = grammar, tokenizer

    def __call__(self) -> GrammarProcessor:
        return GrammarProcessor(self._grammar, self._tokenizer)


def _factory(proc: Optional[GrammarProcessor], tokenizer):
    if proc is None:
        return None
    return GrammarFactory(proc.grammar, tokenizer)   # (the shared matcher: each copies it)


def response_format_factory(tokenizer, fmt: Optional[ResponseFormat], **kw):
    """``response_format_processor``'s arguments; a zero-argument factory for
    ``SamplingParams.processor_factories`` (a fresh processor per request) or
    None. The grammar is compiled and checked now (ConstraintError)."""
    return _factory(response_format_processor(tokenizer, fmt, **kw), tokenizer)


def tool_choice_factory(tokenizer, tool_format: Any, tools: Optional[Sequence[dict]],
                        choice: ToolChoice, **kw):
    """``tool_choice_processor``'s arguments; a factory as ``response_format_factory``."""
    return _factory(tool_choice_processor(tokenizer, tool_format, tools, choice, **kw), tokenizer)
