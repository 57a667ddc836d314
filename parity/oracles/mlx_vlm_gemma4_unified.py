"""mlx-vlm 0.7.x's encoder-free Gemma 4 (`gemma4_unified` model and its processor) as the
live oracle of the `gemma4_unified` image path (imported only by the parity code): the
model patches and positions its processor makes, the embedder's soft tokens, the merged
embeddings and its token loop. Its processor pads every image's patches to
`max_soft_tokens` (position -1) and batches the images; the model drops the padding."""

from __future__ import annotations

import mlx.core as mx

from .mlx_vlm_gemma4 import load as _load, prepare  # noqa: F401  (the same inputs)


def load(path):
    """(model, processor): `mlx_vlm.load`'s model, and the processor its AutoProcessor hook
    names (`Gemma4UnifiedProcessor.from_pretrained`, which reads processor_config.json;
    through `mlx_vlm.load` this fixture's processor falls back to the released defaults)."""
    from mlx_vlm.models.gemma4_unified import Gemma4UnifiedProcessor
    model, _ = _load(path)
    return model, Gemma4UnifiedProcessor.from_pretrained(str(path))


def patch_list(inp) -> list:
    """The processor's model patches of each image, padding dropped: [n, m*m*3]."""
    pos = inp["image_position_ids"]
    out = []
    for i in range(inp["pixel_values"].shape[0]):
        n = int(mx.sum(mx.any(pos[i] != -1, axis=-1)).item())
        out.append(inp["pixel_values"][i, :n])
    return out


def features(model, inp) -> mx.array:
    """The soft tokens of all images [tokens, text width] (embedder + embed_vision)."""
    return model.get_image_features(inp["pixel_values"], inp["image_position_ids"])


def embeddings(model, ids: mx.array, inp) -> mx.array:
    return model.get_input_embeddings(ids, inp["pixel_values"],
                                      image_position_ids=inp["image_position_ids"]).inputs_embeds


def forward_logits(model, ids: mx.array, inp, steps: int) -> tuple:
    """The logits of mlx-vlm's schedule (prompt but its last token in one chunk, the last
    token, then `steps` greedy tokens), each [V], and the greedy tokens."""
    lm = model.language_model
    cache = lm.make_cache()
    emb = embeddings(model, ids, inp)
    lm(ids[:, :-1], inputs_embeds=emb[:, :-1], cache=cache)
    out = lm(ids[:, -1:], inputs_embeds=emb[:, -1:], cache=cache).logits[0, -1]
    logits, tokens = [out], []
    for _ in range(steps):
        tok = mx.argmax(out).item()
        tokens.append(tok)
        out = lm(mx.array([[tok]]), cache=cache).logits[0, -1]
        logits.append(out)
    return logits, tokens


def generate(model, ids: mx.array, inp, max_tokens: int) -> list:
    """mlx-vlm's own `generate_step` (greedy): [(token, logprobs [V])]."""
    from mlx_vlm.generate.ar import generate_step
    out = []
    for tok, lp in generate_step(ids, model, inp["pixel_values"], mx.ones(ids.shape, mx.int32),
                                 max_tokens=max_tokens, temperature=0.0,
                                 image_position_ids=inp["image_position_ids"]):
        out.append((int(tok), lp))
        if len(out) == max_tokens:
            break
    return out
