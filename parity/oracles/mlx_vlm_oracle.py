"""mlx-vlm 0.7.x as the live oracle of the image path (imported only by the parity code):
its model and processor for a checkpoint, the pixel values and prompt ids its processor
makes, the vision features, the merged embeddings and its own token loop."""

from __future__ import annotations

import mlx.core as mx


def load(path):
    """(model, processor) as `mlx_vlm.load` gives them."""
    from mlx_vlm import load as vlm_load
    return vlm_load(str(path))


def prepare(model, processor, images: list, text: str):
    """What mlx_vlm.generate's `prepare_inputs` makes of a templated prompt and images
    (PIL images or bytes): {"input_ids", "pixel_values", "attention_mask"}."""
    from io import BytesIO

    from mlx_vlm.utils import load_image, prepare_inputs
    pil = [load_image(BytesIO(i)) if isinstance(i, (bytes, bytearray)) else i for i in images]
    return prepare_inputs(processor, images=pil, prompts=[text],
                          image_token_index=model.config.image_token_index,
                          add_special_tokens=False)


def features(model, pixels: mx.array, dtype) -> mx.array:
    hidden, _, _ = model.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype),
                                      output_hidden_states=True)
    return model.multi_modal_projector(hidden)


def embeddings(model, ids: mx.array, pixels: mx.array) -> mx.array:
    return model.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape, mx.int32)).inputs_embeds


def forward_logits(model, ids: mx.array, pixels: mx.array, steps: int) -> tuple:
    """The logits of mlx-vlm's schedule (prompt but its last token in one chunk, the last
    token, then `steps` greedy tokens), each [V], and the greedy tokens."""
    lm = model.language_model
    cache = lm.make_cache()
    emb = embeddings(model, ids, pixels)
    lm(ids[:, :-1], inputs_embeds=emb[:, :-1], cache=cache)
    out = lm(ids[:, -1:], inputs_embeds=emb[:, -1:], cache=cache).logits[0, -1]
    logits, tokens = [out], []
    for _ in range(steps):
        tok = mx.argmax(out).item()
        tokens.append(tok)
        out = lm(mx.array([[tok]]), cache=cache).logits[0, -1]
        logits.append(out)
    return logits, tokens


def generate(model, ids: mx.array, pixels: mx.array, max_tokens: int) -> list:
    """mlx-vlm's own `generate_step` (greedy): [(token, logprobs [V])]."""
    from mlx_vlm.generate.ar import generate_step
    out = []
    for tok, lp in generate_step(ids, model, pixels, mx.ones(ids.shape, mx.int32),
                                 max_tokens=max_tokens, temperature=0.0):
        out.append((int(tok), lp))
        if len(out) == max_tokens:
            break
    return out


def quantized(src, bits: int):
    """`src` quantized by mlx-vlm's own converter (group 64; the vision tower stays float,
    the decoder's head is stored quantized): the layout of the mlx-community VLM
    checkpoints. Cached beside `src` (built once, atomically)."""
    import shutil
    import tempfile
    from pathlib import Path

    from mlx_vlm import convert

    src = Path(src)
    final = src.parent / f"{src.name}-mlxvlm-q{bits}"
    if (final / "config.json").exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=src.parent))
    try:
        convert(hf_path=str(src), mlx_path=str(tmp / "out"), quantize=True, q_bits=bits,
                q_group_size=64)
        try:
            (tmp / "out").rename(final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
