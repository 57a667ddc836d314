"""Structured outputs and enforced tool choice on the server: request fields ->
`engine.constrained` grammar processors in `SamplingParams.processor_factories`.

Each protocol module calls `check_constraints` where it translates its request
(OpenAI chat/completions `response_format`, Responses `text.format`, every
protocol's `tool_choice`): a value the server cannot honour is a 400 naming the
field, and the parsed values go on the `Call`. `chat.start()` then asks
`compile_factories` for the factories, so the constraint runs inside the
engine, in the solo and the batched lane alike, with one fresh processor per
request. The server forces the format from the first generated token (it does
not separate reasoning from content).

Compiling a grammar can take seconds for a large schema, so `start()` asks for
it only after the prompt, context, memory and queue checks, and
`compile_factories` runs it on a small pool of worker threads (llguidance
drops the GIL while it builds), never on the event loop: `/health` and the
other streams go on meanwhile. A schema over `--max-schema-nodes` JSON nodes
is refused before compiling; a compile still running after `--max-grammar-ms`
is a 400 naming the limit (the thread cannot be stopped: it finishes on its
own, and its grammar is kept in the compiled-grammar cache).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from .errors import bad_request

COMPILE_THREADS = 2
_POOL = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar")


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
    from engine import DEFAULT_MAX_SCHEMA_NODES

    fmt = getattr(call, "response_format", None)
    choice = getattr(call, "tool_choice", None)
    nodes = getattr(state.config, "max_schema_nodes", None) or DEFAULT_MAX_SCHEMA_NODES
    out = []
    try:
        if choice is not None and choice.forces_call and call.tools:
            tool_format = tool_format_for(state.tokenizer, state.model_type)
            if tool_format is None:
                raise bad_request("tool_choice cannot be enforced: this model has no known "
                                  "tool-call format", param="tool_choice")
            out.append(tool_choice_factory(state.tokenizer, tool_format, call.tools, choice,
                                           parallel=getattr(call, "parallel_tool_calls", True),
                                           max_schema_nodes=nodes))
        elif fmt is not None:     # (a forced call is the whole output: no format on top)
            out.append(response_format_factory(state.tokenizer, fmt, max_schema_nodes=nodes))
    except ConstraintError as e:
        param = getattr(call, "format_param", "response_format") \
            if e.param.startswith("response_format") else e.param
        raise bad_request(str(e), param=param) from None
    return tuple(f for f in out if f is not None)


def constrained(call) -> bool:
    """Whether `call` asks for a grammar (a response format or a forced call)."""
    fmt = getattr(call, "response_format", None)
    choice = getattr(call, "tool_choice", None)
    return ((fmt is not None and fmt.type != "text")
            or (choice is not None and choice.forces_call and bool(call.tools)))


def constraint_param(call) -> str:
    """The request field a grammar error names."""
    choice = getattr(call, "tool_choice", None)
    if choice is not None and choice.forces_call and call.tools:
        return "tool_choice"
    return getattr(call, "format_param", "response_format")


def _compile(abandoned: threading.Event, make, state, call) -> tuple:
    if abandoned.is_set():        # its request was answered while it waited for a thread
        return ()
    return make(state, call)


def _retrieve(fut) -> None:
    if not fut.cancelled():
        fut.exception()           # (a compile that outlived its budget: nobody awaits it)


async def compile_factories(state, call, make=None) -> tuple:
    """`make(state, call)` (`processor_factories`) on the grammar threads, within
    `--max-grammar-ms` (a 400 naming the limit past it); inline when `call` asks
    for no grammar (nothing to compile)."""
    make = make or processor_factories
    if not constrained(call):
        return tuple(make(state, call))
    ms = getattr(state.config, "max_grammar_ms", None) or DEFAULT_MAX_GRAMMAR_MS
    abandoned = threading.Event()
    fut = asyncio.get_running_loop().run_in_executor(_POOL, _compile, abandoned, make,
                                                     state, call)
    fut.add_done_callback(_retrieve)
    try:
        return await asyncio.wait_for(asyncio.shield(fut), ms / 1000.0)
    except asyncio.TimeoutError:
        abandoned.set()           # (not started yet: it never will)
        param = constraint_param(call)
        raise bad_request(f"{param}: the grammar did not compile within {ms:g} ms, the limit "
                          f"(--max-grammar-ms); use a smaller or simpler schema",
                          param=param) from None


DEFAULT_MAX_GRAMMAR_MS = 2000.0
INLINE_SCHEMA_NODES = 2000


def _check_tool_schemas(tools: list) -> None:
    from engine import check_json_schema

    for i, t in enumerate(tools):
        fn = t["function"]
        try:
            check_json_schema(fn.get("parameters", fn.get("input_schema")),
                              f"tools[{i}].parameters")
        except ValueError as e:
            raise bad_request(str(e), param="tools") from None


async def check_tool_schemas(tools) -> None:
    """Each tool's parameters checked against the JSON Schema meta-schema (a 400
    naming `tools`); on a worker thread when they are large (the check is Python)."""
    if not tools:
        return
    from engine import schema_nodes
    if schema_nodes(tools, stop=INLINE_SCHEMA_NODES) <= INLINE_SCHEMA_NODES:
        _check_tool_schemas(tools)
    else:
        await asyncio.to_thread(_check_tool_schemas, tools)
