"""mlx-vlm 0.7.x as the live oracle of Qwen2.5-VL's image path (imported only by the parity
code): its processor's pixel values, grids and prompt ids, the tower's features, the merged
embeddings with the M-RoPE positions, the logits of its schedule and its own token loop.

mlx-vlm's language model keeps the last request's positions on itself (`_position_ids`,
`_rope_deltas`); every entry point here clears them first, so one run cannot leak into the
next."""

from __future__ import annotations

from io import BytesIO

import mlx.core as mx


def load(path):
    """(model, processor) as `mlx_vlm.load` gives them."""
    from mlx_vlm import load as vlm_load
    return vlm_load(str(path))


def make_cache(model) -> list:
    """mlx-vlm's KV caches for the language model (as generate_step makes them)."""
    from mlx_vlm.models.cache import make_prompt_cache
    return make_prompt_cache(model.language_model)


def reset(model) -> None:
    model.language_model._position_ids = None
    model.language_model._rope_deltas = None


def prepare(model, processor, images: list, text: str) -> dict:
    """What mlx_vlm.generate's `prepare_inputs` makes of a templated prompt and images:
    {"input_ids", "pixel_values", "image_grid_thw", "attention_mask"}."""
    from mlx_vlm.utils import load_image, prepare_inputs
    pil = [load_image(BytesIO(i)) if isinstance(i, (bytes, bytearray)) else i for i in images]
    return prepare_inputs(processor, images=pil, prompts=[text],
                          image_token_index=model.config.image_token_id,
                          add_special_tokens=False)


def features(model, pixels: mx.array, grid: mx.array) -> mx.array:
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    return model.vision_tower(pixels.astype(dtype), grid)


def embeddings(model, ids: mx.array, pixels: mx.array, grid: mx.array):
    """mlx-vlm's get_input_embeddings: (inputs_embeds, position_ids [3, 1, L], rope_deltas)."""
    reset(model)
    out = model.get_input_embeddings(ids, pixels, image_grid_thw=grid,
                                     mask=mx.ones(ids.shape, mx.int32))
    return out.inputs_embeds, out.position_ids, out.rope_deltas


def forward_logits(model, ids: mx.array, pixels: mx.array, grid: mx.array, steps: int) -> tuple:
    """The logits of generate_step's schedule (the prompt but its last token in one chunk,
    the last token, both with the prompt's positions; then `steps` greedy tokens without
    them), each [V], and the greedy tokens."""
    lm = model.language_model
    emb, pos, deltas = embeddings(model, ids, pixels, grid)
    cache = make_cache(model)
    kw = {"position_ids": pos, "rope_deltas": deltas}
    lm(ids[:, :-1], inputs_embeds=emb[:, :-1], cache=cache, **kw)
    out = lm(ids[:, -1:], inputs_embeds=emb[:, -1:], cache=cache, **kw).logits[0, -1]
    logits, tokens = [out], []
    for _ in range(steps):
        tok = mx.argmax(out).item()
        tokens.append(tok)
        out = lm(mx.array([[tok]]), cache=cache).logits[0, -1]
        logits.append(out)
    return logits, tokens


def generate(model, ids: mx.array, pixels: mx.array, grid: mx.array, max_tokens: int) -> list:
    """mlx-vlm's own `generate_step` (greedy): [(token, logprobs [V])]."""
    from mlx_vlm.generate.ar import generate_step
    reset(model)
    out = []
    for tok, lp in generate_step(ids, model, pixels, mx.ones(ids.shape, mx.int32),
                                 max_tokens=max_tokens, temperature=0.0, image_grid_thw=grid):
        out.append((int(tok), lp))
        if len(out) == max_tokens:
            break
    return out
