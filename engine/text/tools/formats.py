"""The tool-call formats by name, and which one a model family uses."""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

from engine.text.tools import gemma4, json_tools, minicpm5, qwen3_coder
from engine.text.tools.base import ToolFormat

FORMATS: Dict[str, ToolFormat] = {
    f.name: f for f in (gemma4.FORMAT, minicpm5.FORMAT, json_tools.FORMAT, qwen3_coder.FORMAT)
}

_ALIASES = {
    "hermes": "json_tools", "json": "json_tools", "qwen": "json_tools", "llama": "json_tools",
    "minicpm": "minicpm5", "qwen_xml": "qwen3_coder",
}
# model_type prefixes, longest first wins
_FAMILIES = (
    ("gemma4", "gemma4"),
    ("minicpm", "minicpm5"),
    ("qwen3_5", "qwen3_coder"),
    ("qwen3_next", "qwen3_coder"),
    ("qwen3_coder", "qwen3_coder"),
    ("qwen", "json_tools"),
)


def get_tool_format(family_or_model_type: Union[str, ToolFormat]) -> ToolFormat:
    """The tool-call format of a model family.

    Accepts a format name (``gemma4``, ``minicpm5``, ``json_tools``,
    ``qwen3_coder``, alias ``hermes``), or a config ``model_type``:
    ``gemma4*`` -> gemma4; ``minicpm*`` -> minicpm5; ``qwen3_5*``,
    ``qwen3_next*`` -> qwen3_coder; other ``qwen*`` and ``llama`` -> json_tools
    (both ``<tool_call>`` formats read JSON and equals-XML bodies).
    Raises ValueError for anything else (e.g. gemma3, llama4, mistral)."""
    if isinstance(family_or_model_type, ToolFormat):
        return family_or_model_type
    if not isinstance(family_or_model_type, str):
        raise ValueError(f"expected a model_type or format name, got {family_or_model_type!r}")
    key = family_or_model_type.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    for prefix, name in _FAMILIES:
        if key.startswith(prefix):
            return FORMATS[name]
    raise ValueError(
        f"no tool-call format for {family_or_model_type!r}; formats: {', '.join(FORMATS)}; "
        "families: gemma4*, minicpm*, qwen*, llama")


def tool_format_for(tokenizer: Any = None, model_type: Optional[str] = None) -> Optional[ToolFormat]:
    """The tool-call format of a loaded model: the one its chat template asks
    for (``tokenizer.tool_parser_type``, inferred from the template as mlx-lm
    does) when it is one of ours, else the ``model_type`` family's; None when
    neither gives one. A MiniCPM5 checkpoint (``model_type: llama``) gets
    ``minicpm5`` from its template, not ``json_tools`` from ``llama``."""
    inferred = getattr(tokenizer, "tool_parser_type", None)
    if isinstance(inferred, str) and inferred in FORMATS:
        return FORMATS[inferred]
    if model_type:
        try:
            return get_tool_format(model_type)
        except ValueError:
            return None
    return None
