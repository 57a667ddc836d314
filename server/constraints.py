"""Structured outputs and enforced tool choice on the server: request fields ->
`engine.constrained` grammar processors in `SamplingParams.processor_factories`.

Each protocol module calls `check_constraints` where it translates its request
(OpenAI chat/completions `response_format`, Responses `text.format`, every
protocol's `tool_choice`): a value the server cannot honour is a 400 naming the
field, and the parsed values go on the `Call`. `chat.start()` then asks
`processor_factories` for the factories, so the constraint runs inside the
engine, in the solo and the batched lane alike, with one fresh processor per
request. The server forces the format from the first generated token (it does
not separate reasoning from content).
"""

from __future__ import annotations

from .errors import bad_request


def check_constraints(response_format, tool_choice, tools,
                      format_param: str = "response_format"):
    """(ResponseFormat or None, ToolChoice or None) of the request. Known fields
    with values we cannot honour are a 400 naming the field: an unknown response
    format type or a bad schema, a tool_choice naming a tool that is not among
    the tools (or forcing a call with no tools)."""
    from engine import ConstraintError, parse_response_format, parse_tool_choice
    try:
        fmt = parse_response_format(response_format, param=format_param)
        choice = parse_tool_choice(tool_choice, tools) if tool_choice is not None else None
    except ConstraintError as e:
        raise bad_request(str(e), param=e.param) from None
    return fmt, choice


def apply_constraints(call, response_format, tool_choice, tools,
                      format_param: str = "response_format", parallel: bool = True) -> None:
    """`check_constraints`, keeping the parsed values on `call` for `start()`."""
    call.response_format, call.tool_choice = check_constraints(
        response_format, tool_choice, tools, format_param)
    call.format_param = format_param
    call.parallel_tool_calls = parallel


def processor_factories(state, call) -> tuple:
    """The grammar processor factories `call` asks for (empty when none); a 400
    when the grammar cannot be built (a schema llguidance rejects, a forced call
    on a model with no tool-call format)."""
    from engine import ConstraintError, response_format_factory, tool_choice_factory
    from engine import tool_format_for

    fmt = getattr(call, "response_format", None)
    choice = getattr(call, "tool_choice", None)
    out = []
    try:
        if choice is not None and choice.forces_call and call.tools:
            tool_format = tool_format_for(state.tokenizer, state.model_type)
            if tool_format is None:
                raise bad_request("tool_choice cannot be enforced: this model has no known "
                                  "tool-call format", param="tool_choice")
            out.append(tool_choice_factory(state.tokenizer, tool_format, call.tools, choice,
                                           parallel=getattr(call, "parallel_tool_calls", True)))
        elif fmt is not None:     # (a forced call is the whole output: no format on top)
            out.append(response_format_factory(state.tokenizer, fmt))
    except ConstraintError as e:
        param = getattr(call, "format_param", "response_format") \
            if e.param.startswith("response_format") else e.param
        raise bad_request(str(e), param=param) from None
    return tuple(f for f in out if f is not None)
