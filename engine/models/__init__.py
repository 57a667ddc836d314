"""Architectures, registered by HF `model_type`."""

from . import gemma3, gemma3_text, gemma4, gemma4_text, llama, minicpm, qwen2, qwen2_5_vl, qwen3, qwen3_moe

REGISTRY = {
    "llama": (llama.Model, llama.Args),
    "mistral": (llama.Model, llama.Args),
    "qwen2": (qwen2.Model, qwen2.Args),
    "qwen3": (qwen3.Model, qwen3.Args),
    "qwen3_moe": (qwen3_moe.Model, qwen3_moe.Args),
    "minicpm": (minicpm.Model, minicpm.Args),
    "gemma3_text": (gemma3_text.Model, gemma3_text.Args),
    "gemma4_text": (gemma4_text.Model, gemma4_text.Args),
}

# Multimodal wrappers: the text decoder of a config nested under `text_config`.
# gemma3 builds its vision tower when the config describes one (engine.models.gemma3).
# qwen2_5_vl: Qwen2.5-VL, its vision tower and M-RoPE decoder (engine.models.qwen2_5_vl).
# gemma4_unified is the encoder-free Gemma 4 checkpoint (its vision weights are dropped).
WRAPPERS = {
    "gemma3": (gemma3.Model, gemma3.text_args),
    "gemma4": (gemma4.Model, gemma4.text_args),
    "gemma4_unified": (gemma4.Model, gemma4.text_args),
    "qwen2_5_vl": (qwen2_5_vl.Model, qwen2_5_vl.text_args),
}


def supported() -> list[str]:
    return sorted([*REGISTRY, *WRAPPERS])


def build(config: dict):
    """Instantiate the (randomly initialised) model a config describes."""
    kind = config.get("model_type")
    if kind in WRAPPERS:
        model_cls, text_args = WRAPPERS[kind]
        build_from = getattr(model_cls, "from_config", None)   # (a wrapper with a tower)
        model = build_from(config) if build_from else model_cls(text_args(config))
        model.model_type = kind
        return model
    if kind not in REGISTRY:
        raise ValueError(f"unsupported model_type {kind!r}; supported: {supported()}")
    model_cls, args_cls = REGISTRY[kind]
    return model_cls(args_cls.from_dict(config))
