"""Architectures, registered by HF `model_type`."""

from . import gemma4, gemma4_text, llama, minicpm, qwen3

REGISTRY = {
    "llama": (llama.Model, llama.Args),
    "mistral": (llama.Model, llama.Args),
    "qwen3": (qwen3.Model, qwen3.Args),
    "minicpm": (minicpm.Model, minicpm.Args),
    "gemma4_text": (gemma4_text.Model, gemma4_text.Args),
}


def build(config: dict):
    """Instantiate the (randomly initialised) model a config describes."""
    kind = config.get("model_type")
    if kind == "gemma4":
        return gemma4.Model(gemma4.text_args(config))
    if kind not in REGISTRY:
        raise ValueError(f"unsupported model_type {kind!r}; supported: "
                         f"{sorted([*REGISTRY, 'gemma4'])}")
    model_cls, args_cls = REGISTRY[kind]
    return model_cls(args_cls.from_dict(config))
