"""Tokenizer: encode/decode, chat templates, streaming detokenization.

``load_tokenizer(model_dir)`` reads a Hugging Face style checkpoint directory
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
``chat_template.jinja``, ``generation_config.json``, ``config.json``) and returns
a :class:`Tokenizer` that behaves like mlx-lm's ``TokenizerWrapper`` around a
transformers 5 ``TokenizersBackend``:

- ``encode`` / ``decode`` are the ``tokenizers`` library's, configured the way
  transformers configures it (no truncation/padding, ``split_special_tokens``,
  ``clean_up_tokenization_spaces`` ignored for BPE models as transformers 5 does).
- ``apply_chat_template`` renders the Jinja template in an environment built to
  behave like transformers' (sandboxed, ``trim_blocks``/``lstrip_blocks``,
  ``loopcontrols``, ``raise_exception``, ``strftime_now``, a non-escaping
  ``tojson``, the ``{% generation %}`` tag), with the named special tokens as
  variables, and encodes the result without adding special tokens. As mlx-lm
  does, ``enable_thinking`` defaults to ``has_thinking``.
- ``eos_token_ids`` is what ``mlx_lm.load`` ends up with: config.json's
  ``eos_token_id``, replaced by generation_config.json's when that is truthy,
  plus the tokenizer's ``eos_token``.
- ``detokenizer`` is a streaming detokenizer whose text is always exactly
  ``decode(tokens)`` once finalized, and which never emits part of a UTF-8
  character.

This module imports neither mlx_lm nor transformers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "StreamingDetokenizer",
    "ByteLevelDetokenizer",
    "DecodeDetokenizer",
    "render_chat_template",
    "NAMED_SPECIAL_TOKENS",
]

NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Thinking delimiters that are one token each, in the order mlx-lm tries them.
_SINGLE_TOKEN_THINKING = (
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
)
_XTML_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


# ---------------------------------------------------------------------------
# Byte-level alphabet (GPT-2): every byte is shown as one printable character.
# ---------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_level_char_to_byte() -> dict[str, int]:
    # Printable Latin-1 bytes keep their own character; the others (controls,
    # space, DEL, NBSP, soft hyphen ...) are shifted to U+0100 and upwards in
    # byte order.
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[str, int] = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


def _token_bytes(token: str) -> bytes:
    """The bytes a ByteLevel decoder produces for one token string.

    A token made only of alphabet characters is mapped back byte by byte; any
    other token (an added token such as ``"\\n"`` or ``"x y"``) is taken as
    UTF-8 text, which is what the ``tokenizers`` ByteLevel decoder does.
    """
    table = _byte_level_char_to_byte()
    out = bytearray()
    for ch in token:
        b = table.get(ch)
        if b is None:
            return token.encode("utf-8")
        out.append(b)
    return bytes(out)


def _incomplete_utf8_tail(buf: bytes | bytearray) -> int:
    """Number of trailing bytes that are the valid start of an unfinished character.

    Those bytes may still become a character when more bytes arrive, so a
    streaming decoder holds them back. Anything else (complete characters and
    invalid bytes) can be decoded now: a maximal invalid subpart never extends
    over a lead byte, so decoding in pieces cut here gives the same text as
    decoding the whole.
    """
    n = len(buf)
    for k in range(1, min(3, n) + 1):
        c = buf[n - k]
        if 0x80 <= c <= 0xBF:
            continue
        if 0xC2 <= c <= 0xDF:
            need = 2
        elif 0xE0 <= c <= 0xEF:
            need = 3
        elif 0xF0 <= c <= 0xF4:
            need = 4
        else:
            return 0
        if k >= need:
            return 0
        if k >= 2:
            second = buf[n - k + 1]
            if (
                (c == 0xE0 and second < 0xA0)
                or (c == 0xED and second > 0x9F)
                or (c == 0xF0 and second < 0x90)
                or (c == 0xF4 and second > 0x8F)
            ):
                return 0
        return k
    return 0


# ---------------------------------------------------------------------------
# Streaming detokenizers
# ---------------------------------------------------------------------------


class StreamingDetokenizer:
    """Interface: ``reset``, ``add_token``, ``finalize``, ``text``, ``tokens``, ``last_segment``.

    ``text`` is the text decoded so far (text that might still change is held
    back); ``last_segment`` is the text added since it was last read;
    after ``finalize()``, ``text == tokenizer.decode(tokens)``.
    """

    tokens: list[int]

    def reset(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def add_token(self, token: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def finalize(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def text(self) -> str:
        return self._text

    @property
    def last_segment(self) -> str:
        seg = self._segment
        self._segment = ""
        return seg

    def _emit(self, piece: str) -> None:
        if not piece:
            return
        if self._trim_pending:
            self._trim_pending = False
            if piece[0] == " ":
                piece = piece[1:]
                if not piece:
                    return
        self._text += piece
        self._segment += piece


class ByteLevelDetokenizer(StreamingDetokenizer):
    """Linear-time streaming decoder for byte-level BPE tokenizers.

    Keeps the bytes of an unfinished UTF-8 character pending until it is
    complete (or proven invalid), so no segment ever holds part of a character
    or a replacement character that the full decode would not have.

    ``trim_leading_space=True`` drops one space at the very start of the text,
    as mlx-lm's ``BPEStreamingDetokenizer`` does; the default gives exactly
    ``decode(tokens)``.
    """

    def __init__(
        self,
        token_bytes: list[bytes],
        special_ids: frozenset[int] = frozenset(),
        *,
        skip_special_tokens: bool = False,
        trim_leading_space: bool = False,
    ) -> None:
        self._token_bytes = token_bytes
        self._special_ids = special_ids
        self.skip_special_tokens = skip_special_tokens
        self.trim_leading_space = trim_leading_space
        self.reset()

    def reset(self) -> None:
        self.tokens = []
        self._pending = b""
        self._text = ""
        self._segment = ""
        self._trim_pending = self.trim_leading_space

    def add_token(self, token: int) -> None:
        token = int(token)
        self.tokens.append(token)
        if token < 0 or token >= len(self._token_bytes):
            return  # decode() ignores ids outside the vocabulary
        if self.skip_special_tokens and token in self._special_ids:
            return
        buf = self._pending + self._token_bytes[token]
        hold = _incomplete_utf8_tail(buf)
        if hold:
            ready, self._pending = buf[:-hold], buf[-hold:]
        else:
            ready, self._pending = buf, b""
        if ready:
            self._emit(ready.decode("utf-8", "replace"))

    def finalize(self) -> None:
        if self._pending:
            self._emit(self._pending.decode("utf-8", "replace"))
            self._pending = b""


class DecodeDetokenizer(StreamingDetokenizer):
    """Fallback for tokenizers without a ByteLevel decoder (quadratic time).

    Re-decodes all tokens after each one and emits the new text, holding back
    trailing replacement characters until more tokens arrive.
    """

    def __init__(self, decode, *, skip_special_tokens: bool = False, trim_leading_space: bool = False):
        self._decode = decode
        self.skip_special_tokens = skip_special_tokens
        self.trim_leading_space = trim_leading_space
        self.reset()

    def reset(self) -> None:
        self.tokens = []
        self._text = ""
        self._segment = ""
        self._raw = ""
        self._trim_pending = self.trim_leading_space

    def _advance(self, final: bool) -> None:
        full = self._decode(self.tokens, skip_special_tokens=self.skip_special_tokens)
        stable = full if final else full.rstrip("\ufffd")
        if stable.startswith(self._raw) and len(stable) > len(self._raw):
            piece = stable[len(self._raw) :]
            self._raw = stable
            self._emit(piece)

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        self._advance(final=False)

    def finalize(self) -> None:
        self._advance(final=True)


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
    if all(tok in vocab for tok in _XTML_TOKENS):
        return "kimi_k3"
    if "<|tool_call_start|>" in vocab and "<|tool_call_end|>" in vocab:
        return "pythonic"
    return None


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError:
        return None


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _clean_up_tokenization(text: str) -> str:
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


class Tokenizer:
    """A checkpoint's tokenizer with mlx-lm ``TokenizerWrapper`` semantics."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        tokenizer_config: Mapping[str, Any] | None = None,
        *,
        special_tokens_map: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        chat_template: str | dict | list | None = None,
        eos_token_ids: Iterable[int] | int | None = None,
        name_or_path: str | None = None,
    ) -> None:
        cfg = dict(tokenizer_config or {})
        self.name_or_path = name_or_path
        self.config = cfg
        self._backend = backend
        # transformers disables any truncation/padding stored in tokenizer.json
        # for plain encode calls.
        backend.no_truncation()
        backend.no_padding()
        self.split_special_tokens = bool(cfg.get("split_special_tokens", False))
        backend.encode_special_tokens = self.split_special_tokens

        self._backend_json = json.loads(backend.to_str())
        self._is_bpe = (self._backend_json.get("model") or {}).get("type") == "BPE"
        self._decoder_spec = self._backend_json.get("decoder")
        self._byte_level = isinstance(self._decoder_spec, dict) and self._decoder_spec.get("type") == "ByteLevel"

        # Named special tokens: tokenizer_config, and special_tokens_map.json only
        # when the config has no added_tokens_decoder (transformers 5 rule).
        specials: dict[str, str] = {}
        for key in NAMED_SPECIAL_TOKENS:
            content = _token_content(cfg.get(key))
            if content is not None:
                specials[key] = content
        if special_tokens_map and "added_tokens_decoder" not in cfg:
            for key, value in special_tokens_map.items():
                if key in NAMED_SPECIAL_TOKENS:
                    content = _token_content(value)
                    if content is not None:
                        specials[key] = content
        # Other string-valued ``*_token`` keys are model-specific named tokens
        # (e.g. image_token) and are template variables too.
        for key, value in cfg.items():
            if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS and isinstance(value, str):
                specials[key] = value
        self.special_tokens_map: dict[str, str] = specials

        self._vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.added_tokens = {i: t.content for i, t in added.items()}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)

        # Chat template: a string, or named templates (dict or list of {name, template}).
        if chat_template is None:
            chat_template = cfg.get("chat_template")
        if isinstance(chat_template, list):
            chat_template = {t["name"]: t["template"] for t in chat_template}
        self._chat_templates = chat_template
        self.chat_template = (
            chat_template.get("default") if isinstance(chat_template, dict) else chat_template
        )
        self.has_chat_template = chat_template is not None

        # eos ids as mlx_lm.load computes them.
        ids: list[int] = []
        if eos_token_ids is None:
            conf = dict(model_config or {})
            gen_eos = (generation_config or {}).get("eos_token_id", False)
            if gen_eos:
                conf["eos_token_id"] = gen_eos
            eos_token_ids = conf.get("eos_token_id")
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        ids.extend(int(i) for i in (eos_token_ids or []))
        self._eos_token_ids = set(ids)
        if self.eos_token_id is not None:
            self._eos_token_ids.add(self.eos_token_id)
        self.generation_config = dict(generation_config or {})

        self._infer_thinking()
        self.tool_parser_type = cfg.get("tool_parser_type") or infer_tool_parser_type(
            self.chat_template, self._vocab
        )

        if self._byte_level:
            self._token_bytes = [
                _token_bytes(backend.id_to_token(i) or "") for i in range(self.vocab_size)
            ]
        else:
            self._token_bytes = None

    # -- special tokens ---------------------------------------------------

    def _special_id(self, key: str) -> int | None:
        content = self.special_tokens_map.get(key)
        return None if content is None else self._vocab.get(content)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value) -> None:
        self._eos_token_ids = set(value) if value is not None else set()

    def add_eos_token(self, token: int | str) -> None:
        """Add a stop token, given as an id or as a token string."""
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            token_id = self._vocab.get(token)
        if token_id is None:
            raise ValueError(f"{token!r} is not a token of this tokenizer")
        self._eos_token_ids.add(token_id)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special_ids)

    # -- thinking ---------------------------------------------------------

    def _infer_thinking(self) -> None:
        self.think_start = self.think_end = None
        self.think_start_tokens = self.think_end_tokens = None
        for start, end in _SINGLE_TOKEN_THINKING:
            if start in self._vocab and end in self._vocab:
                self.think_start, self.think_end = start, end
                self.think_start_tokens = (self._vocab[start],)
                self.think_end_tokens = (self._vocab[end],)
                return
        if "<|channel>" in self._vocab and "<channel|>" in self._vocab:
            start, end = "<|channel>thought", "<channel|>"
        elif all(t in self._vocab for t in _XTML_TOKENS):
            start, end = "<|open|>think<|sep|>", "<|close|>think<|sep|>"
        else:
            return
        self.think_start, self.think_end = start, end
        self.think_start_tokens = tuple(self.encode(start, add_special_tokens=False))
        self.think_end_tokens = tuple(self.encode(end, add_special_tokens=False))

    @property
    def has_thinking(self) -> bool:
        return self.think_start is not None

    @property
    def think_start_id(self) -> int | None:
        if self.think_start_tokens is None:
            return None
        if len(self.think_start_tokens) > 1:
            raise ValueError("the thinking start marker is more than one token")
        return self.think_start_tokens[0]

    @property
    def think_end_id(self) -> int | None:
        if self.think_end_tokens is None:
            return None
        if len(self.think_end_tokens) > 1:
            raise ValueError("the thinking end marker is more than one token")
        return self.think_end_tokens[0]

    # -- encode / decode --------------------------------------------------

    @property
    def backend(self) -> _BackendTokenizer:
        return self._backend

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int] | int, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        # transformers 5 ignores clean_up_tokenization_spaces for BPE models
        # unless explicitly forced.
        if self.config.get("clean_up_tokenization_spaces", False) and (
            not self._is_bpe
            or self.config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        ):
            text = _clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._vocab.get(tokens)
        return [self._vocab.get(t) for t in tokens]

    # -- streaming --------------------------------------------------------

    def make_detokenizer(
        self, *, skip_special_tokens: bool = False, trim_leading_space: bool = False
    ) -> StreamingDetokenizer:
        """A fresh streaming detokenizer.

        ``trim_leading_space=True`` reproduces mlx-lm's BPE streaming text,
        which drops one space at the very start of the output.
        """
        needs_cleanup = self.config.get("clean_up_tokenization_spaces", False) and (
            not self._is_bpe
            or self.config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )
        if self._token_bytes is not None and not needs_cleanup:
            return ByteLevelDetokenizer(
                self._token_bytes,
                self.special_ids,
                skip_special_tokens=skip_special_tokens,
                trim_leading_space=trim_leading_space,
            )
        return DecodeDetokenizer(
            self.decode, skip_special_tokens=skip_special_tokens, trim_leading_space=trim_leading_space
        )

    @property
    def detokenizer(self) -> StreamingDetokenizer:
        """A fresh streaming detokenizer (one per request)."""
        return self.make_detokenizer()

    # -- chat templates ---------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        if chat_template is not None and not (
            isinstance(self._chat_templates, dict) and chat_template in self._chat_templates
        ):
            return chat_template
        templates = self._chat_templates
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates[chat_template]
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"no default chat template among {sorted(templates)}")
        if templates is None:
            raise ValueError("this tokenizer has no chat template")
        return templates

    def apply_chat_template(
        self,
        messages: list,
        tools: list | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        *,
        continue_final_message: bool | str = False,
        documents: list | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ):
        """Render (and by default tokenize) a conversation.

        Returns token ids, or the rendered string when ``tokenize=False``.
        ``enable_thinking`` defaults to ``has_thinking`` (mlx-lm's default);
        pass it explicitly to override. Extra keyword arguments become
        template variables and override the special-token variables.
        """
        if "enable_thinking" not in template_kwargs:
            template_kwargs["enable_thinking"] = self.has_thinking
        template = self.get_chat_template(chat_template, tools)
        variables = {**self.special_tokens_map, **template_kwargs}
        text = render_chat_template(
            template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **variables,
        )
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name_or_path!r}, vocab={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={sorted(self.eos_token_ids)}, pad={self.pad_token_id})"
        )


def load_tokenizer(model_dir: str | Path, eos_token_ids: Iterable[int] | int | None = None) -> Tokenizer:
    """Load the tokenizer of a local checkpoint directory (never downloads)."""
    path = Path(model_dir)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise FileNotFoundError(f"{tj} not found (only tokenizer.json checkpoints are supported)")
    backend = _BackendTokenizer.from_file(str(tj))
    cfg = _read_json(path / "tokenizer_config.json") or {}
    # chat_template.jinja and additional_chat_templates/*.jinja take priority
    # over the template in tokenizer_config.json (as in transformers).
    templates: dict[str, str] = {}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    chat_template: str | dict | None = None
    if list(templates) == ["default"]:
        chat_template = templates["default"]
    elif templates:
        chat_template = templates
    return Tokenizer(
        backend,
        cfg,
        special_tokens_map=_read_json(path / "special_tokens_map.json"),
        generation_config=_read_json(path / "generation_config.json"),
        model_config=_read_json(path / "config.json"),
        chat_template=chat_template,
        eos_token_ids=eos_token_ids,
        name_or_path=str(path),
    )
