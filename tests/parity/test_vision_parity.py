"""L1 of the image path against mlx-vlm 0.7.x (the live oracle): Gemma 3's preprocessing
(pixel values), the SigLIP tower + projector's features, the merged input embeddings, the
logits at every step and the greedy tokens, all with `mx.array_equal`, on the
`gemma3_vision` fixture (float32 and bfloat16; random weights in mlx-vlm's layout) and its
4- and 8-bit versions made by mlx-vlm's converter (decoder quantized, tower float)."""

import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from engine import Engine, SamplingParams
from engine.loader import load_model
from engine.text.tokenizer import load_tokenizer
from engine.vision import preprocessor_for
from parity.oracles import mlx_vlm_oracle as vlm
from starter.vision import ensure_vision_fixture

pytestmark = pytest.mark.parity
STEPS = 12


def _png(arr, mode=None, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, fmt, **kw) if mode else Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def _images() -> dict:
    rng = np.random.default_rng(7)
    rgba = rng.integers(0, 256, (40, 23, 4), dtype=np.uint8)
    jpeg = rng.integers(0, 256, (71, 50, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6                      # orientation: rotate 90 degrees
    buf = io.BytesIO()
    Image.fromarray(jpeg).save(buf, "JPEG", exif=exif.tobytes())
    return {"rgb_png": _png(rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)),
            "rgba_png": _png(rgba),
            "gray_webp": _png(rng.integers(0, 256, (9, 200), dtype=np.uint8), fmt="WEBP"),
            "exif_jpeg": buf.getvalue(),
            "bmp_exact": _png(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), fmt="BMP")}


IMAGES = _images()
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Describe this."},
                                         {"type": "image"}]}]
TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                    {"type": "image"}, {"type": "text", "text": "compare"}]}]


@pytest.fixture(scope="module", params=["float32", "bfloat16", "q4", "q8"])
def setup(request):
    if request.param in ("q4", "q8"):      # quantized by mlx-vlm's converter
        path = vlm.quantized(ensure_vision_fixture("bfloat16"), int(request.param[1]))
    else:
        path = ensure_vision_fixture(request.param)
    ref, processor = vlm.load(path)
    ours, _ = load_model(path)
    return path, ref, processor, ours, load_tokenizer(path)


def _ours(setup, messages, images):
    path, _, _, ours, tok = setup
    eng = Engine(ours, tok)
    eng.image_preprocess = preprocessor_for(ours, path)
    return eng.vision_prompt(messages, images)


def _oracle(setup, messages, images):
    _, ref, processor, _, tok = setup
    text = tok.apply_chat_template(messages, tokenize=False)
    return vlm.prepare(ref, processor, images, text)


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixel_values_equal_the_processors(setup, name):
    ids, vision = _ours(setup, MESSAGES, [IMAGES[name]])
    inp = _oracle(setup, MESSAGES, [IMAGES[name]])
    assert vision.pixels.dtype == inp["pixel_values"].dtype == mx.float32
    assert mx.array_equal(vision.pixels, inp["pixel_values"]).item()
    # mlx-vlm's processor adds a second <bos> to the template's (its tokenizer default):
    # the rest of the prompt ids, the expanded image tokens included, are ours
    bos = setup[4].bos_token_id
    assert inp["input_ids"][0].tolist() == [bos] + ids
    assert ids.count(setup[3].vision.image_token_id) == 16


def test_features_and_embeddings_equal(setup):
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, TWO, [IMAGES["rgb_png"], IMAGES["exif_jpeg"]])
    dtype = ours.language_model.model.embed_tokens(mx.array([0])).dtype
    got = ours.image_features(vision.pixels, dtype)
    want = vlm.features(ref, vision.pixels, dtype)
    assert got.shape == (2, 16, 64) and mx.array_equal(got, want).item()
    e = vlm.embeddings(ref, mx.array([ids]), vision.pixels)
    assert mx.array_equal(ours.embed_prompt(ids, vision.pixels), e).item()
    # the images do change the embeddings (a model that ignores them would fail above)
    assert not mx.array_equal(e, ref.language_model.model.embed_tokens(mx.array([ids]))).item()


def test_logits_every_step_and_greedy_tokens(setup):
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, MESSAGES, [IMAGES["rgba_png"]])
    want, want_tokens = vlm.forward_logits(ref, mx.array([ids]), vision.pixels, STEPS)
    cache = ours.make_cache()
    emb = ours.embed_prompt(ids, vision.pixels)
    x = mx.array([ids])
    ours(x[:, :-1], cache=cache, input_embeddings=emb[:, :-1])
    out = ours(x[:, -1:], cache=cache, input_embeddings=emb[:, -1:])[0, -1]
    got, tokens = [out], []
    for _ in range(STEPS):
        tokens.append(mx.argmax(out).item())
        out = ours(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        got.append(out)
    assert tokens == want_tokens
    for i, (a, b) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), f"step {i}: max|diff| {mx.abs(a - b).max().item()}"


def test_engine_matches_mlx_vlm_generate_step(setup):
    """The Engine's request (vision_prompt + submit) against mlx-vlm's own token loop."""
    path, ref, _, ours, tok = setup
    eng = Engine(ours, tok, keep_logprob_arrays=True)
    eng.image_preprocess = preprocessor_for(ours, path)
    ids, vision = eng.vision_prompt(TWO, [IMAGES["gray_webp"], IMAGES["bmp_exact"]])
    want = vlm.generate(ref, mx.array([ids]), vision.pixels, STEPS)
    eng.eos = set()                        # run all the steps (a random model may end early)
    rid = eng.submit(ids, SamplingParams(max_tokens=STEPS, temperature=0.0), vision=vision)
    toks, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == rid and o.error is None
            toks += o.token_ids
            lps += o.logprob_arrays
    assert toks == [t for t, _ in want]
    for i, (a, (_, b)) in enumerate(zip(lps, want)):
        assert mx.array_equal(a, b).item(), f"step {i}"
    assert eng.stats()["solo_reasons"] == {"max_batch=1": 1}    # (the exact runner)
