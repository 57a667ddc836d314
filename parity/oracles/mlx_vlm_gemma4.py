"""mlx-vlm 0.7.x's Gemma 4 (`gemma4` model and Gemma4Processor) as the live oracle of the
Gemma 4 image path (imported only by the parity code): the pixel values and prompt ids its
processor makes, the tower's soft tokens, the merged embeddings and its token loop."""

from __future__ import annotations

import mlx.core as mx


def load(path):
    """(model, processor) as `mlx_vlm.load` gives them."""
    from mlx_vlm import load as vlm_load
    return vlm_load(str(path))


def prepare(model, processor, images: list, text: str):
    """What mlx_vlm.generate's `prepare_inputs` makes of a templated prompt and images
    (bytes): {"input_ids", "pixel_values", ...}; pixel_values [N, 3, H, W] when the images'
    sizes agree, else a list of [3, H, W]."""
    from io import BytesIO

    from mlx_vlm.utils import load_image, prepare_inputs
    pil = [load_image(BytesIO(i)) for i in images]
    return prepare_inputs(processor, images=pil, prompts=[text],
                          image_token_index=model.config.image_token_id,
                          add_special_tokens=False)


def pixel_list(pixels) -> list:
    """The processor's pixel values as a list of [3, H, W] arrays."""
    if isinstance(pixels, (list, tuple)):
        return [mx.array(p) for p in pixels]
    return [pixels[i] for i in range(pixels.shape[0])]


def features(model, pixels) -> mx.array:
    """The soft tokens of all images [tokens, text width] (tower + embed_vision)."""
    return model.encode_image(pixels)[0]


def embeddings(model, ids: mx.array, pixels) -> mx.array:
    return model.get_input_embeddings(ids, pixels).inputs_embeds


def forward_logits(model, ids: mx.array, pixels, steps: int) -> tuple:
    """The logits of mlx-vlm's schedule (prompt but its last token in one chunk, the last
    token, then `steps` greedy tokens), each [V], and the greedy tokens. The prompt's
    per-layer inputs (E2B-style decoders) are the ones `get_input_embeddings` makes."""
    lm = model.language_model
    cache = lm.make_cache()
    feats = model.get_input_embeddings(ids, pixels)
    emb, pli = feats.inputs_embeds, feats.per_layer_inputs   # (pli: the image tokens' as 0)
    cut = (lambda a, s: None if a is None else a[:, s])
    lm(ids[:, :-1], inputs_embeds=emb[:, :-1], cache=cache,
       per_layer_inputs=cut(pli, slice(None, -1)))
    out = lm(ids[:, -1:], inputs_embeds=emb[:, -1:], cache=cache,
             per_layer_inputs=cut(pli, slice(-1, None))).logits[0, -1]
    logits, tokens = [out], []
    for _ in range(steps):
        tok = mx.argmax(out).item()
        tokens.append(tok)
        out = lm(mx.array([[tok]]), cache=cache).logits[0, -1]
        logits.append(out)
    return logits, tokens


def generate(model, ids: mx.array, pixels, max_tokens: int) -> list:
    """mlx-vlm's own `generate_step` (greedy): [(token, logprobs [V])]."""
    from mlx_vlm.generate.ar import generate_step
    out = []
    for tok, lp in generate_step(ids, model, pixels, mx.ones(ids.shape, mx.int32),
                                 max_tokens=max_tokens, temperature=0.0):
        out.append((int(tok), lp))
        if len(out) == max_tokens:
            break
    return out


def token_types(model, ids: mx.array) -> mx.array:
    """The processor's `mm_token_type_ids` for prompt ids (1: image token, else 0)."""
    return (ids == model.config.image_token_id).astype(mx.int32)


def whole_forward_logits(model, ids: mx.array, pixels, steps: int, types=True, **kw) -> tuple:
    """The logits of mlx-vlm's schedule for a prompt with images when the decoder attends
    to them both ways (`use_bidirectional_attention: "vision"`: its chunked-prefill policy
    is off, the whole prompt is one forward with the prompt's `mm_token_type_ids`), then
    `steps` greedy tokens: ([V] each, tokens). `types=False`: without the token types (no
    overlay: the negative control). `kw`: more inputs of `get_input_embeddings`
    (gemma4_unified: `image_position_ids`)."""
    lm = model.language_model
    cache = lm.make_cache()
    feats = model.get_input_embeddings(ids, pixels, **kw)
    extra = {"mm_token_type_ids": token_types(model, ids)} if types else {}
    out = lm(ids, inputs_embeds=feats.inputs_embeds, cache=cache,
             per_layer_inputs=feats.per_layer_inputs, logits_to_keep=1, **extra).logits[0, -1]
    logits, tokens = [out], []
    for _ in range(steps):
        tok = mx.argmax(out).item()
        tokens.append(tok)
        out = lm(mx.array([[tok]]), cache=cache, **extra).logits[0, -1]
        logits.append(out)
    return logits, tokens


def generate_with_types(model, ids: mx.array, pixels, max_tokens: int, **kw) -> list:
    """`generate` with the prompt's `mm_token_type_ids`, as mlx_vlm.generate passes the
    processor's."""
    from mlx_vlm.generate.ar import generate_step
    out = []
    for tok, lp in generate_step(ids, model, pixels, mx.ones(ids.shape, mx.int32),
                                 max_tokens=max_tokens, temperature=0.0,
                                 mm_token_type_ids=token_types(model, ids), **kw):
        out.append((int(tok), lp))
        if len(out) == max_tokens:
            break
    return out


def whole_then_cached(model, ids: mx.array, pixels, fed: list, suffix: list, steps: int,
                      **kw) -> tuple:
    """A prompt-cache hit's schedule on mlx-vlm's model: `whole_forward_logits`' forward of
    `ids` (with the token types), the tokens `fed` one a forward (the cache then holds what a
    finished request leaves), then a text `suffix` on that cache as mlx-vlm prefills any
    prompt (all but its last token in one forward, the last token), then `steps` greedy
    tokens: (logprobs [V] from the suffix's last token on, tokens)."""
    lm = model.language_model
    cache = lm.make_cache()
    feats = model.get_input_embeddings(ids, pixels, **kw)
    extra = {"mm_token_type_ids": token_types(model, ids)}
    lm(ids, inputs_embeds=feats.inputs_embeds, cache=cache,
       per_layer_inputs=feats.per_layer_inputs, logits_to_keep=1, **extra)
    for tok in fed:
        lm(mx.array([[tok]]), cache=cache, **extra)
    if len(suffix) > 1:
        lm(mx.array([suffix[:-1]]), cache=cache)
    out = lm(mx.array([suffix[-1:]]), cache=cache).logits[0, -1]
    lps, tokens = [], []
    for i in range(steps):
        lps.append(out - mx.logsumexp(out, axis=-1, keepdims=True))
        tokens.append(mx.argmax(out).item())
        if i + 1 < steps:
            out = lm(mx.array([[tokens[-1]]]), cache=cache).logits[0, -1]
    return lps, tokens
