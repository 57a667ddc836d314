"""Tiny models built offline, laid out like real checkpoints.

Each fixture is a directory with `config.json` (the keys real checkpoints of
that family carry, written explicitly so no library default decides
anything), seeded random weights in `model.safetensors` (or shards plus
`model.safetensors.index.json`), and a locally trained tokenizer with the
family's special tokens and chat template. Quantized variants use the format
mlx-lm writes (a `quantization` block in config.json, packed weights with
`scales`/`biases`).

Weights come from MLX's default initialisation under a fixed seed; every
1-D parameter (norm weights, Gemma's `layer_scalar`) is then shifted by
0.1·N(0,1) so an implementation that ignores a norm weight is caught.

Fixtures are deterministic (same seed, same bytes), cached under
`starter.cache_root()` (`$MLXP_FIXTURE_DIR`, else the user cache), and never committed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

BUILDER_VERSION = "1"
VOCAB = 1024

_COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=4096, vocab_size=VOCAB)

# Dims: head_dim >= 32 everywhere so 4/8-bit KV quantization (group 32) applies;
# llama's head_dim 64 also takes group 64.
FAMILIES: dict[str, dict] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, rope_theta=500000.0, rope_traditional=False,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        attention_bias=False, mlp_bias=False, hidden_act="silu", tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64,
        num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, rope_theta=1000000.0, rope_scaling=None,
        attention_bias=False, hidden_act="silu", tie_word_embeddings=True,
        sliding_window=None, use_sliding_window=False,
    ),
    "minicpm": dict(
        architectures=["MiniCPMForCausalLM"], model_type="minicpm", hidden_size=64,
        num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, dim_model_base=32, scale_depth=1.4, scale_emb=12.0,
        rope_theta=10000.0, rope_scaling=None, hidden_act="silu",
        tie_word_embeddings=False,  # mlx-lm's minicpm cannot load tied heads
    ),
    # E2B-style: sliding/full pattern, KV sharing for the last 2 layers, per-layer inputs.
    "gemma4_text": dict(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_size=64,
        num_hidden_layers=6, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, global_head_dim=64, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=30.0, use_double_wide_mlp=True, attention_k_eq_v=False,
        enable_moe_block=False, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    ),
}

# 31B-style dense Gemma 4 in the released multimodal wrapper: HF weight names,
# `attention_k_eq_v` with its own global KV head count, no KV sharing.
FAMILIES["gemma4"] = dict(
    architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", vocab_size=VOCAB,
    text_config={**{k: v for k, v in FAMILIES["gemma4_text"].items() if k != "architectures"},
                 **_COMMON, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
                 "attention_k_eq_v": True, "num_key_value_heads": 2,
                 "num_global_key_value_heads": 1},
    vision_config={"model_type": "gemma4_vision", "hidden_size": 16},
)

# Qwen2.5-0.5B-style: q/k/v biases, tied head.
FAMILIES["qwen2"] = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
    num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
    num_key_value_heads=1, rope_theta=1000000.0, rope_scaling=None, hidden_act="silu",
    tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
    max_window_layers=2,
)
# Gemma 3 1B-style text decoder: S S F S S F, window 16, (1 + w) norms, tied head.
FAMILIES["gemma3_text"] = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=64,
    num_hidden_layers=6, intermediate_size=128, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
    sliding_window_pattern=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
    attn_logit_softcapping=None,
)
# Gemma 3 4B-style multimodal wrapper: linear RoPE scaling on global layers, a vision tower.
FAMILIES["gemma3"] = dict(
    architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", vocab_size=VOCAB,
    text_config={**{k: v for k, v in FAMILIES["gemma3_text"].items() if k != "architectures"},
                 **_COMMON, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    vision_config={"model_type": "siglip_vision_model", "hidden_size": 16},
)
# Qwen3-30B-A3B-style MoE: 8 experts, top-2, renormalised; layer 1 stays dense.
FAMILIES["qwen3_moe"] = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
    num_hidden_layers=3, intermediate_size=128, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, rope_theta=1000000.0, rope_scaling=None,
    attention_bias=False, hidden_act="silu", tie_word_embeddings=False,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
    mlp_only_layers=[1], norm_topk_prob=True, sliding_window=None, use_sliding_window=False,
)
# Gemma 4 26B-A4B-style MoE in the released wrapper: dense MLP + 8 experts (top-2)
# side by side, attention_k_eq_v on full layers, no KV sharing, no per-layer inputs.
FAMILIES["gemma4_moe"] = dict(
    architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", vocab_size=VOCAB,
    text_config={**{k: v for k, v in FAMILIES["gemma4_text"].items() if k != "architectures"},
                 **_COMMON, "num_hidden_layers": 4, "intermediate_size": 64,
                 "layer_types": ["sliding_attention", "full_attention"] * 2,
                 "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
                 "attention_k_eq_v": True, "num_key_value_heads": 2,
                 "num_global_key_value_heads": 1, "enable_moe_block": True,
                 "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 64},
    vision_config={"model_type": "gemma4_vision", "hidden_size": 16},
)
# Encoder-free Gemma 4 (`gemma4_unified`): a dense decoder plus `vision_embedder.*` weights.
FAMILIES["gemma4_unified"] = dict(
    architectures=["Gemma4UnifiedForConditionalGeneration"], model_type="gemma4_unified",
    vocab_size=VOCAB,
    text_config={**{k: v for k, v in FAMILIES["gemma4_text"].items() if k != "architectures"},
                 **_COMMON, "num_hidden_layers": 4,
                 "layer_types": ["sliding_attention", "sliding_attention",
                                 "sliding_attention", "full_attention"],
                 "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0},
)

TOKENIZER_FAMILY = {"llama": "llama", "qwen3": "qwen3", "minicpm": "minicpm",
                    "gemma4_text": "gemma4", "gemma4": "gemma4", "qwen2": "qwen2",
                    "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3_moe": "qwen3",
                    "gemma4_moe": "gemma4", "gemma4_unified": "gemma4"}
DTYPES = ("float32", "bfloat16", "q4", "q8")
# Fixture variants, two kinds in one table:
# - config variants, `ensure_fixture(family, variant=...)` (fixture name gets "-<variant>"):
#   config overrides. "tp2": 4 query / 2 KV heads, so every head count splits over 2
#   tensor-parallel ranks.
# - checkpoint variants, used as the family name (`ensure_fixture("minicpm5_llama")`): one
#   family's architecture with another's tokenizer ({"family": ..., "tokenizer": ...}).
#   Released MiniCPM5 checkpoints are `model_type: llama` with MiniCPM5's template (its
#   thinking and tool-call format).
#   "long": the built-in long-context model (`builtin:long`), a context of 131,072 tokens
#   so a coding agent's first request (tools and system prompt, ~20-40K tokens) fits; its
#   build tweaks (LONG_BUILD) make its answers end after a few dozen tokens.
VARIANTS: dict[str, dict] = {
    "tp2": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "long": {"max_position_embeddings": 131072},
    "minicpm5_llama": {"family": "llama", "tokenizer": "minicpm"},
}
# Build tweaks of a config variant (part of the fixture's hash, never of config.json):
# - eos_scale: the EOS tokens' embedding rows (= the tied head's rows) scaled by this, so a
#   random model ends its answer after a few dozen tokens instead of running to the context
#   limit (a client that sets no max tokens would wait minutes for a 100K-token answer);
# - generation_config: written as generation_config.json (Qwen3's own sampling defaults).
VARIANT_BUILD: dict[str, dict] = {
    "long": {"eos_scale": 8.0, "generation_config": {
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}},
}
SEEDS = {"llama": 1, "qwen3": 2, "minicpm": 3, "gemma4_text": 4, "gemma4": 5, "qwen2": 6,
         "gemma3_text": 7, "gemma3": 8, "qwen3_moe": 9, "gemma4_moe": 10, "gemma4_unified": 11}
# Families with expert layers: mlx's gather_mm has no bfloat16 kernel on the CPU, so
# their float bfloat16 fixture can be built anywhere but only run on a GPU.
MOE = ("qwen3_moe", "gemma4_moe")
# Families with sliding-window layers (a rotating KV cache; quantized KV is L2 against mlx-optiq).
SLIDING = ("gemma4_text", "gemma4", "gemma3_text", "gemma3", "gemma4_moe", "gemma4_unified")


def cpu_dtypes(family: str) -> tuple:
    """The fixture dtypes both engines can run on the CPU for this family."""
    return tuple(d for d in DTYPES if not (family in MOE and d == "bfloat16"))


def _checkpoint_variant(name: str) -> bool:
    return "family" in VARIANTS.get(name, {})


def _config_variant(name: str) -> bool:
    return name in VARIANTS and not _checkpoint_variant(name)


def _resolve(family: str) -> tuple:
    """(architecture family, tokenizer family) of a fixture name."""
    if _checkpoint_variant(family):
        v = VARIANTS[family]
        return v["family"], v["tokenizer"]
    return family, TOKENIZER_FAMILY[family]


def fixture_root() -> Path:
    from .paths import cache_root
    return cache_root()


def config_for(family: str, tok_ids: dict, variant: str = "") -> dict:
    cfg = copy.deepcopy(FAMILIES[family])
    if variant:
        cfg.get("text_config", cfg).update(VARIANTS[variant])
    ids = {"bos_token_id": tok_ids["bos_token_id"], "eos_token_id": tok_ids["eos_token_id"],
           "pad_token_id": tok_ids["pad_token_id"]}
    if "text_config" in cfg:
        cfg["text_config"].update(ids)
        cfg.update(ids)
    else:
        cfg = {**_COMMON, **cfg, **ids}  # family keys override the common ones
    return cfg


def _as_first_built(config: dict):
    """qwen3 and qwen2 models as engine 0.4.0 and earlier built them, for their random draws:
    llama's layers first, then each layer's attention (qwen3) or output projection without
    bias (qwen2) built a second time. The built-in fixtures' weights are those draws, so they,
    and the tests tuned on them, stay as they were; the engine now builds each module once,
    in mlx-lm's order (a seeded run draws what mlx-lm's does). None for other model types."""
    import mlx.nn as nn

    from engine.models import REGISTRY, build, llama, qwen3
    kind = config.get("model_type")
    if kind not in ("qwen3", "qwen2"):
        return None
    args = REGISTRY[kind][1].from_dict(config)
    first = llama.Model(args)
    for layer in first.model.layers:
        if kind == "qwen3":
            layer.self_attn = qwen3.Attention(args)
        else:
            attn = layer.self_attn
            attn.o_proj = nn.Linear(attn.n_heads * attn.head_dim, args.hidden_size, bias=False)
    model = build(config)
    model.update(first.parameters())
    return model


def _random_weights(family: str, config: dict, seed: int) -> dict:
    from engine.models import build

    mx.random.seed(seed)
    model = _as_first_built(config) or build(config)
    params = dict(tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed + 1000), len(params))  # one per name, sorted
    out = {}
    for i, (name, v) in enumerate(sorted(params.items())):
        if v.ndim <= 1:
            v = v + 0.1 * mx.random.normal(v.shape, key=keys[i])
        out[name] = v
    return model, out


def _unstack_experts(family: str, weights: dict) -> dict:
    """Float MoE checkpoints as HF ships them (quantized ones keep mlx-lm's
    stacked layout, which is what its converter writes)."""
    out = {}
    for k, v in weights.items():
        if family == "qwen3_moe" and ".mlp.switch_mlp." in k:
            base, name = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{name}"] = v[e]
        elif family == "gemma4_moe" and ".switch_glu.gate_proj." in k:
            up = weights[k.replace(".gate_proj.", ".up_proj.")]
            out[k.replace(".switch_glu.gate_proj.weight", ".gate_up_proj")] = mx.concatenate(
                [v, up], axis=-2)
        elif family == "gemma4_moe" and ".switch_glu.down_proj." in k:
            out[k.replace(".switch_glu.down_proj.weight", ".down_proj")] = v
        elif not (family == "gemma4_moe" and ".switch_glu.up_proj." in k):
            out[k] = v
    return out


def _hf_names(family: str, weights: dict, quantized: bool = False) -> dict:
    """The names a released checkpoint uses (what `sanitize` must undo)."""
    if family in MOE and not quantized:
        weights = _unstack_experts(family, weights)
    if family in ("gemma3_text", "gemma3"):
        # Gemma 3 checkpoints tie the head by leaving lm_head out.
        weights = {k: v for k, v in weights.items()
                   if not k.startswith(("lm_head.", "language_model.lm_head."))}
        if family == "gemma3":
            weights["vision_tower.vision_model.embeddings.patch_embedding.weight"] = mx.zeros((4, 4))
            weights["multi_modal_projector.mm_input_projection_weight"] = mx.zeros((4, 4))
        return weights
    if family not in ("gemma4", "gemma4_moe", "gemma4_unified"):
        return weights
    out = {}
    for k, v in weights.items():
        out[k.replace("language_model.model.", "model.language_model.", 1)] = v
    # A released multimodal checkpoint also carries towers the text engine drops.
    tower = "vision_embedder" if family == "gemma4_unified" else "vision_tower"
    out[f"model.{tower}.patch_embed.weight"] = mx.zeros((4, 4))
    return out


def _quantize(model: nn.Module, weights: dict, bits: int, group_size: int = 64):
    """Quantize the float model the way mlx-lm's converter does (layers whose
    input dim divides the group size), returning the packed weights."""
    model.load_weights(list(weights.items()))
    family_rule = getattr(model, "quant_predicate", None)   # e.g. MoE routers at 8 bits
    overrides = {}

    def pred(path, m):
        if not (hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0):
            return False
        rule = family_rule(path, m) if family_rule is not None else True
        if isinstance(rule, dict):
            overrides[path] = rule
        return rule
    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=pred)
    return dict(tree_flatten(model.parameters())), overrides


def _save_weights(out: Path, weights: dict, shards: int):
    weights = dict(sorted(weights.items()))
    mx.eval(list(weights.values()))
    if shards <= 1:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    names = list(weights)
    per = (len(names) + shards - 1) // shards
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in names[s * per:(s + 1) * per]}
        mx.save_safetensors(str(out / fname), part, metadata={"format": "mlx"})
        weight_map.update({k: fname for k in part})
        total += sum(v.nbytes for v in part.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))


def _apply_tweaks(weights: dict, tweaks: dict, tok_ids: dict, out: Path) -> dict:
    eos = tok_ids["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else list(eos)
    scale = tweaks.get("eos_scale")
    if scale:
        keys = [k for k in weights if k.endswith(("embed_tokens.weight", "lm_head.weight"))]
        for k in keys:
            weights[k] = weights[k].at[mx.array(eos)].multiply(scale)
    gc = tweaks.get("generation_config")
    if gc is not None:          # over the tokenizer's (its EOS ids and the rest stay)
        f = out / "generation_config.json"
        have = json.loads(f.read_text()) if f.exists() else {"eos_token_id": eos}
        f.write_text(json.dumps({**have, **gc}, indent=2, sort_keys=True))
    return weights


def build_fixture(out: Path, family: str, dtype: str = "float32", shards: int = 1,
                  variant: str = "") -> Path:
    from .tokenizers import build_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arch, tok_family = _resolve(family)
    tok_ids = build_tokenizer(out, tok_family, vocab_size=VOCAB)
    config = config_for(arch, tok_ids, variant)
    model, weights = _random_weights(arch, config, SEEDS[arch])
    tweaks = VARIANT_BUILD.get(variant, {})
    if tweaks:
        weights = _apply_tweaks(weights, tweaks, tok_ids, out)
    float_dtype = mx.float32 if dtype == "float32" else mx.bfloat16
    weights = {k: v.astype(float_dtype) for k, v in weights.items()}
    if dtype in ("q4", "q8"):
        bits = 4 if dtype == "q4" else 8
        model.set_dtype(mx.bfloat16)
        weights, overrides = _quantize(model, weights, bits)
        q = {"group_size": 64, "bits": bits, "mode": "affine"}
        config["quantization"] = {**q, **overrides}
        config["quantization_config"] = {**q, **overrides}
    config["torch_dtype"] = "float32" if dtype == "float32" else "bfloat16"
    _save_weights(out, _hf_names(arch, weights, quantized=dtype in ("q4", "q8")), shards)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


@lru_cache(maxsize=1)
def _tokenizer_key() -> str:
    from . import tokenizers as t
    return f"{t.BUILDER_VERSION}:{t.corpus_hash()}"


def fixture_name(family: str, dtype: str = "float32", shards: int = 1, variant: str = "") -> str:
    """Directory name: readable part + hash of everything that shapes the bytes."""
    name = f"{family}-{dtype}" + (f"-sharded{shards}" if shards > 1 else "")
    arch, tok_family = _resolve(family)
    parts = [BUILDER_VERSION, _tokenizer_key(), FAMILIES[arch], dtype, shards]
    if _checkpoint_variant(family):
        parts.append(tok_family)
    if variant:
        name += f"-{variant}"
        parts.append(VARIANTS[variant])
        if variant in VARIANT_BUILD:
            parts.append(VARIANT_BUILD[variant])
    spec = json.dumps(parts, sort_keys=True)
    return f"{name}-{hashlib.sha1(spec.encode()).hexdigest()[:8]}"


def ensure_fixture(family: str, dtype: str = "float32", shards: int = 1,
                   variant: str = "") -> Path:
    """Path of the cached fixture, building it first (atomically) if needed."""
    if family not in FAMILIES and not _checkpoint_variant(family):
        raise ValueError(f"unknown fixture family {family!r}; have {sorted(FAMILIES)} and "
                         f"{sorted(v for v in VARIANTS if _checkpoint_variant(v))}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown fixture dtype {dtype!r}; have {DTYPES}")
    if variant and not _config_variant(variant):
        raise ValueError(f"unknown fixture variant {variant!r}; have "
                         f"{sorted(v for v in VARIANTS if _config_variant(v))}")
    return build_once(fixture_root() / fixture_name(family, dtype, shards, variant),
                      lambda tmp: build_fixture(tmp, family, dtype, shards, variant))


def build_once(final: Path, build) -> Path:
    """`final`, built first by `build(tmp)` into a temporary folder beside it and renamed into
    place (atomically: concurrent builders race, the loser's copy is equal and dropped)."""
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").exists():  # lost a race: the winner's copy is equal
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Build the offline test fixtures")
    p.add_argument("--family", action="append", choices=sorted(FAMILIES))
    p.add_argument("--dtype", action="append", choices=DTYPES)
    args = p.parse_args(argv)
    for fam in args.family or sorted(FAMILIES):
        for dt in args.dtype or DTYPES:
            print(ensure_fixture(fam, dt))


if __name__ == "__main__":
    main()


# The pieces a derived fixture builder reuses (`starter.vision`: Gemma 3 with its tower).
random_weights = _random_weights
hf_names = _hf_names
save_weights = _save_weights
tokenizer_key = _tokenizer_key
