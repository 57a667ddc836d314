"""Tiny multimodal fixtures: Gemma 3 with a whole SigLIP tower, in mlx-vlm's layout.

`gemma3_vision` is the `gemma3` fixture's text decoder (same config, same seed, same
weights) plus a vision tower and projector whose random weights are drawn here from an
explicit table of names and shapes (mlx-vlm 0.7.x's layout: the patch convolution
[out, kh, kw, in]), so the engine's vision code does not decide them. Images are 32x32
pixels, 4x4 patches (64 per image), pooled to 16 tokens per image. The directory also has
the files mlx-vlm's processor reads: `preprocessor_config.json` (Gemma3ImageProcessor at
32x32), `processor_config.json` (image_seq_length) and the tokenizer's boi/eoi/image token
names (`extra_special_tokens`). The existing gemma3 fixtures are untouched (their config
carries a tower stub only)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx

from . import models

BUILDER_VERSION = "1"
DTYPES = ("float32", "bfloat16")
VISION_CONFIG = {"model_type": "siglip_vision_model", "hidden_size": 32,
                 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "patch_size": 4, "image_size": 32, "num_channels": 3,
                 "layer_norm_eps": 1e-6, "vision_use_head": False}
TOKENS_PER_IMAGE = 16
SEED = 12
PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "processor_class":
                "Gemma3Processor", "do_convert_rgb": None, "do_normalize": True,
                "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "resample": 2, "rescale_factor": 0.00392156862745098,
                "size": {"height": 32, "width": 32}}
MARKERS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
           "image_token": "<image_soft_token>"}


def vision_weights(cfg: dict, text_width: int, seed: int) -> dict:
    """Random tower + projector weights by name (uniform in +-1/sqrt(fan in) for matrices,
    N(0, 0.02) for biases and position embeddings, 1 + 0.1 N(0, 1) for LayerNorm scales,
    0.1 N(0, 1) for the projector's (1 + w) RMSNorm)."""
    d, i, p, c = (cfg["hidden_size"], cfg["intermediate_size"], cfg["patch_size"],
                  cfg["num_channels"])
    patches = (cfg["image_size"] // p) ** 2
    pre = "vision_tower.vision_model."
    shapes = {f"{pre}embeddings.patch_embedding.weight": ("w", (d, p, p, c), p * p * c),
              f"{pre}embeddings.patch_embedding.bias": ("b", (d,)),
              f"{pre}embeddings.position_embedding.weight": ("b", (patches, d)),
              f"{pre}post_layernorm.weight": ("ln", (d,)),
              f"{pre}post_layernorm.bias": ("b", (d,)),
              "multi_modal_projector.mm_input_projection_weight": ("w", (d, text_width), d),
              "multi_modal_projector.mm_soft_emb_norm.weight": ("rms", (d,))}
    for n in range(cfg["num_hidden_layers"]):
        lp = f"{pre}encoder.layers.{n}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{lp}self_attn.{proj}.weight"] = ("w", (d, d), d)
            shapes[f"{lp}self_attn.{proj}.bias"] = ("b", (d,))
        shapes[f"{lp}mlp.fc1.weight"] = ("w", (i, d), d)
        shapes[f"{lp}mlp.fc1.bias"] = ("b", (i,))
        shapes[f"{lp}mlp.fc2.weight"] = ("w", (d, i), i)
        shapes[f"{lp}mlp.fc2.bias"] = ("b", (d,))
        for ln in ("layer_norm1", "layer_norm2"):
            shapes[f"{lp}{ln}.weight"] = ("ln", (d,))
            shapes[f"{lp}{ln}.bias"] = ("b", (d,))
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    out = {}
    for key, (name, (kind, shape, *fan)) in zip(keys, sorted(shapes.items())):
        if kind == "w":
            bound = fan[0] ** -0.5
            out[name] = mx.random.uniform(-bound, bound, shape, key=key)
        elif kind == "b":
            out[name] = 0.02 * mx.random.normal(shape, key=key)
        elif kind == "ln":
            out[name] = 1.0 + 0.1 * mx.random.normal(shape, key=key)
        else:
            out[name] = 0.1 * mx.random.normal(shape, key=key)
    return out


def config_for(tok_ids: dict) -> dict:
    cfg = models.config_for("gemma3", tok_ids)
    special = tok_ids["special_tokens"]
    cfg["vision_config"] = dict(VISION_CONFIG)
    cfg["mm_tokens_per_image"] = TOKENS_PER_IMAGE
    cfg["text_config"]["mm_tokens_per_image"] = TOKENS_PER_IMAGE   # (where mlx-vlm reads it)
    cfg["hidden_size"] = cfg["text_config"]["hidden_size"]         # (mlx-vlm's merge reads it)
    cfg["image_token_index"] = special[MARKERS["image_token"]]
    cfg["boi_token_index"] = special[MARKERS["boi_token"]]
    cfg["eoi_token_index"] = special[MARKERS["eoi_token"]]
    return cfg


def build(out: Path, dtype: str = "float32") -> Path:
    from .tokenizers import build_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_ids = build_tokenizer(out, "gemma3", vocab_size=models.VOCAB)
    text_cfg = models.config_for("gemma3", tok_ids)        # the gemma3 fixture's decoder
    _, weights = models.random_weights("gemma3", text_cfg, models.SEEDS["gemma3"])
    weights = models.hf_names("gemma3", weights)
    weights = {k: v for k, v in weights.items()             # (its tower stub goes)
               if not k.startswith(("vision_tower.", "multi_modal_projector."))}
    config = config_for(tok_ids)
    weights.update(vision_weights(VISION_CONFIG, config["text_config"]["hidden_size"], SEED))
    float_dtype = mx.float32 if dtype == "float32" else mx.bfloat16
    weights = {k: v.astype(float_dtype) for k, v in weights.items()}
    config["torch_dtype"] = dtype
    models.save_weights(out, weights, 1)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    (out / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"}, indent=2))
    tc = out / "tokenizer_config.json"
    tok = json.loads(tc.read_text())
    tok["extra_special_tokens"] = dict(MARKERS)
    tc.write_text(json.dumps(tok, indent=2, sort_keys=True))
    return out


def fixture_name(dtype: str = "float32") -> str:
    spec = json.dumps([BUILDER_VERSION, models.BUILDER_VERSION, models.tokenizer_key(),
                       models.FAMILIES["gemma3"], VISION_CONFIG, TOKENS_PER_IMAGE, SEED,
                       PREPROCESSOR, dtype], sort_keys=True)
    return f"gemma3_vision-{dtype}-{hashlib.sha1(spec.encode()).hexdigest()[:8]}"


def ensure_vision_fixture(dtype: str = "float32") -> Path:
    """Path of the cached `gemma3_vision` fixture, building it first (atomically)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown vision fixture dtype {dtype!r}; have {DTYPES}")
    return models.build_once(models.fixture_root() / fixture_name(dtype),
                             lambda tmp: build(tmp, dtype))

