"""Chat templates rendered like transformers' ``apply_chat_template``: a sandboxed
Jinja environment with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, ``strftime_now``, a non-escaping ``tojson`` and the
``{% generation %}`` tag; and which tool-call format a template asks for.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["XTML_TOKENS", "check_chat_template", "infer_tool_parser_type", "render_chat_template"]

XTML_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


# ---------------------------------------------------------------------------
# Chat-template environment (behaves like transformers' apply_chat_template)
# ---------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Unlike Jinja's own filter this does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _DictFactory:
    """``dict(...)`` in templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names."""

    def __init__(*args, **kwargs):  # noqa: N805 - same trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
            )


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def check_chat_template(source: str) -> None:
    """Compile a chat template in the rendering environment:
    ``jinja2.TemplateSyntaxError`` (with its line) when it does not parse."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError("a chat template must be a non-empty string")
    _compile_template(source)


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON-like types (as transformers does)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


def _message_to_dict(message: Any) -> dict:
    if isinstance(message, Mapping):
        return dict(message)
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        return dump()
    raise TypeError(f"chat messages must be dicts, dataclasses or pydantic models, got {message!r}")


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _prepare_messages(messages: Iterable[Any]) -> list[dict]:
    out = []
    for message in messages:
        # Keys whose value is None are dropped: templates handle a missing key
        # better than a None one.
        m = {k: v for k, v in _message_to_dict(message).items() if v is not None}
        m = _plain(m)
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(
    template: str,
    messages: list,
    *,
    tools: list | None = None,
    documents: list | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **variables: Any,
) -> str:
    """Render one conversation with a chat template, as transformers would."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    compiled = _compile_template(template)
    if tools is not None:
        schemas = []
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise ValueError("tools must be JSON schemas (dicts); callables are not converted here")
            schemas.append(tool)
        tools = _plain(schemas)
    if documents is not None:
        for doc in documents:
            if not isinstance(doc, Mapping):
                raise TypeError("documents must be a list of dicts")
        documents = _plain(documents)
    variables = _plain(variables)
    chat = _prepare_messages(messages)

    final_message = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_message = chat[-1].get(field)
        if final_message is None:
            raise ValueError(f'continue_final_message: the final message has no "{field}"')
        fields = [field]
        if field in _REASONING_KEYS:
            fields = [k for k in _REASONING_KEYS if chat[-1].get(k) == final_message]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message: "{field}" is not used by the chat template')
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message: no text to continue in the final message")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG

    rendered = compiled.render(
        messages=chat,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )

    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final_message.strip() not in rendered or tag not in rendered:
            raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
        loc = rendered.rindex(tag)
        if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:loc]
        else:
            rendered = rendered[:loc].rstrip()
    return rendered


# ---------------------------------------------------------------------------
# Tool-parser inference (which format a chat template asks the model for)
# ---------------------------------------------------------------------------


def infer_tool_parser_type(chat_template: Any, vocab: Mapping[str, int]) -> str | None:
    """The mlx-lm tool-parser name this template / vocabulary calls for, or None."""
    if isinstance(chat_template, str):
        t = chat_template
        rules = (
            ("minimax_m2", lambda: "<minimax:tool_call>" in t),
            ("gemma4", lambda: "<|tool_call>" in t and "<tool_call|>" in t),
            ("function_gemma", lambda: "<start_function_call>" in t),
            ("longcat", lambda: "<longcat_tool_call>" in t),
            ("glm47", lambda: "<arg_key>" in t),
            ("pythonic", lambda: "<|tool_list_start|>" in t or "<|tool_call_start|>" in t),
            ("qwen3_coder", lambda: "<tool_call>\\n<function=" in t or "<tool_call>\n<function=" in t),
            ("kimi_k2", lambda: "<|tool_calls_section_begin|>" in t),
            ("minicpm5", lambda: '<function name="' in t and '<param name="' in t),
            ("mistral", lambda: "[TOOL_CALLS]" in t),
            ("muse_spark", lambda: "<atem:function_calls>" in t),
            ("json_tools", lambda: "<tool_call>" in t and "tool_call.name" in t),
        )
        for name, test in rules:
            if test():
                return name
    if all(tok in vocab for tok in XTML_TOKENS):
        return "kimi_k3"
    if "<|tool_call_start|>" in vocab and "<|tool_call_end|>" in vocab:
        return "pythonic"
    return None
