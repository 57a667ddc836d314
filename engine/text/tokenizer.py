"""Tokenizer: encode/decode, chat templates (`engine.text.chat_template`), streaming
detokenization (`engine.text.detokenizer`).

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

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterable

from tokenizers import Tokenizer as _BackendTokenizer

from engine.text.chat_template import (XTML_TOKENS, check_chat_template, infer_tool_parser_type,
                            render_chat_template)
from engine.text.prefix_encode import PrefixEncoder
from engine.text.detokenizer import (ByteLevelDetokenizer, DecodeDetokenizer, StreamingDetokenizer,
                          token_bytes)

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
        self._prefix_encoder = PrefixEncoder(backend)   # a grown conversation: its new part

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
                token_bytes(backend.id_to_token(i) or "") for i in range(self.vocab_size)
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
        elif all(t in self._vocab for t in XTML_TOKENS):
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

    def remember_prompt(self, ids: list) -> int:
        """Encode the text of prompt `ids` as a rendered prompt is encoded, so a later prompt
        whose text starts with it encodes only the rest (a restarted server's first agent
        turn: its stored prefix, `Engine.disk_cache.longest_ids`); the tokens of that text."""
        return len(self._prefix_encoder.encode(self.decode(ids, skip_special_tokens=False)))

    @property
    def prefix_tokens_reused(self) -> int:
        """Tokens the prompt encodes took from an earlier prompt's text (a counter)."""
        return self._prefix_encoder.reused

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

    def set_chat_template(self, source: str) -> None:
        """Replace the model's chat template (``engine-serve --chat-template``), as
        mlx-lm's ``tokenizer_config={"chat_template": ...}`` does. The tool-call
        format is inferred again from the new template (unless tokenizer_config
        names one). ``jinja2.TemplateSyntaxError`` / ValueError for a bad template."""
        check_chat_template(source)
        self._chat_templates = self.chat_template = source
        self.has_chat_template = True
        self.tool_parser_type = self.config.get("tool_parser_type") or infer_tool_parser_type(
            source, self._vocab)

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
        return self._prefix_encoder.encode(text)    # == self.encode(text, False)

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
