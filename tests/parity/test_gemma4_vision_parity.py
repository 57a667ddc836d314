"""L1 of the Gemma 4 image path against mlx-vlm 0.7.x (the live oracle): the preprocessing
(pixel values and patches), the vision tower + embed_vision soft tokens, the merged input
embeddings, the logits at every step and the greedy tokens, and the Engine's request against
mlx-vlm's own `generate_step`, all with `mx.array_equal`, on the `gemma4_vision` fixture
(float32 and bfloat16; random weights in mlx-vlm's layout, clipped projections and
standardisation on), with a 31B-style decoder and with an E2B-style one (per-layer inputs:
an image token's are looked up as token 0). A negative control: one tower weight moved by an ulp changes the
soft tokens."""

import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from engine import Engine, SamplingParams
from engine.loader import load_model
from engine.text.tokenizer import load_tokenizer
from engine.vision import preprocessor_for
from engine.vision.gemma4 import target_size, to_patches
from parity.fixtures.gemma4_vision import ensure_fixture
from parity.oracles import mlx_vlm_gemma4 as vlm

pytestmark = pytest.mark.parity
STEPS = 10


def _enc(arr, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def _images() -> dict:
    rng = np.random.default_rng(11)
    jpeg = rng.integers(0, 256, (71, 50, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6                      # orientation: rotate 90 degrees
    buf = io.BytesIO()
    Image.fromarray(jpeg).save(buf, "JPEG", exif=exif.tobytes())
    return {"rgb_png": _enc(rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)),
            "rgba_png": _enc(rng.integers(0, 256, (40, 23, 4), dtype=np.uint8)),
            "gray_webp": _enc(rng.integers(0, 256, (9, 200), dtype=np.uint8), "WEBP"),
            "exif_jpeg": buf.getvalue(),
            "exact_48": _enc(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)),   # no resize
            "large": _enc(rng.integers(0, 256, (300, 170, 3), dtype=np.uint8), "BMP"),
            "square_120": _enc(rng.integers(0, 256, (120, 120, 3), dtype=np.uint8))}


IMAGES = _images()
ONE = [{"role": "user", "content": [{"type": "text", "text": "Describe this."},
                                    {"type": "image"}]}]
TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                    {"type": "image"}, {"type": "text", "text": "compare"}]}]


@pytest.fixture(scope="module", params=[("float32", "dense"), ("bfloat16", "dense"),
                                        ("float32", "ple"), ("bfloat16", "ple")],
                ids=lambda p: "-".join(p))
def setup(request):
    path = ensure_fixture(*request.param)
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
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return vlm.prepare(ref, processor, images, text)


def test_target_size_is_the_processors():
    from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size
    for h, w in [(45, 61), (1, 500), (500, 1), (3, 7), (48, 48), (1080, 1920), (17, 4000)]:
        for patch, tokens, pool in [(4, 16, 3), (16, 280, 3), (16, 70, 3), (16, 1120, 3)]:
            want = get_aspect_ratio_preserving_size(h, w, patch, tokens * pool * pool, pool)
            assert target_size(h, w, patch, tokens * pool * pool, pool) == want


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixel_values_and_prompt_equal_the_processors(setup, name):
    ids, vision = _ours(setup, ONE, [IMAGES[name]])
    inp = _oracle(setup, ONE, [IMAGES[name]])
    (pixels,) = vlm.pixel_list(inp["pixel_values"])
    pre = preprocessor_for(setup[3], setup[0])
    assert pixels.dtype == vision.pixels.dtype == mx.float32
    mine = pre.pixels(Image.open(io.BytesIO(IMAGES[name])).convert("RGB")) \
        if name in ("rgb_png", "exact_48", "large", "square_120") else None
    if mine is not None:                         # (no EXIF / alpha to undo first)
        assert mx.array_equal(mx.array(mine), pixels).item()
    patches, grid = to_patches(np.array(pixels), 4)
    assert mx.array_equal(mx.array(patches), vision.pixels).item()
    assert vision.grids == (grid,)
    # mlx-vlm's processor adds a second <bos> to the template's (its tokenizer default):
    # the rest of the prompt ids, the expanded image tokens included, are ours
    bos = setup[4].bos_token_id
    assert inp["input_ids"][0].tolist() == [bos] + ids
    assert ids.count(setup[3].vision.image_token_id) == vision.tokens == grid[1] * grid[2] // 9


def test_features_and_embeddings_equal(setup):
    _, ref, _, ours, _ = setup
    images = [IMAGES["rgb_png"], IMAGES["exif_jpeg"]]      # two sizes: a list to mlx-vlm
    ids, vision = _ours(setup, TWO, images)
    inp = _oracle(setup, TWO, images)
    got = ours.image_features(vision.pixels, vision.grids)
    want = vlm.features(ref, inp["pixel_values"])
    assert got.shape == (vision.tokens, 64) and mx.array_equal(got, want).item()
    e = vlm.embeddings(ref, mx.array([ids]), inp["pixel_values"])
    assert mx.array_equal(ours.embed_prompt(ids, vision.pixels, vision.grids), e).item()
    # the images do change the embeddings (a model that ignores them would fail above)
    plain = ref.language_model.model.embed_tokens(mx.array([ids])) * (64 ** 0.5)
    assert not mx.array_equal(e, plain).item()


def test_features_same_size_images_batched_by_the_oracle(setup):
    _, ref, _, ours, _ = setup
    images = [IMAGES["exact_48"], IMAGES["square_120"]]    # both 48 x 48 after the resize
    ids, vision = _ours(setup, TWO, images)
    inp = _oracle(setup, TWO, images)
    assert not isinstance(inp["pixel_values"], list) and inp["pixel_values"].shape[0] == 2
    got = ours.image_features(vision.pixels, vision.grids)
    assert mx.array_equal(got, vlm.features(ref, inp["pixel_values"])).item()


def test_one_ulp_in_the_tower_changes_the_features(setup):
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, ONE, [IMAGES["rgb_png"]])
    inp = _oracle(setup, ONE, [IMAGES["rgb_png"]])
    q = ours.vision_tower.encoder.layers[1].self_attn.q_proj.linear
    saved = q.weight
    w = np.array(saved.astype(mx.float32))
    if saved.dtype == mx.float32:
        w[0, 0] = np.nextafter(w[0, 0], np.float32(np.inf))
        moved = mx.array(w)
    else:                                       # bfloat16: the next representable value
        moved = saved.view(mx.uint16)
        moved = mx.where(mx.arange(moved.size).reshape(moved.shape) == 0, moved + 1, moved)
        moved = moved.view(mx.bfloat16)
    assert not mx.array_equal(moved, saved).item()
    try:
        q.weight = moved
        got = ours.image_features(vision.pixels, vision.grids)
    finally:
        q.weight = saved
    assert not mx.array_equal(got, vlm.features(ref, inp["pixel_values"])).item()


def test_logits_every_step_and_greedy_tokens(setup):
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, ONE, [IMAGES["rgba_png"]])
    inp = _oracle(setup, ONE, [IMAGES["rgba_png"]])
    want, want_tokens = vlm.forward_logits(ref, mx.array([ids]), inp["pixel_values"], STEPS)
    cache = ours.make_cache()
    emb = ours.embed_prompt(ids, vision.pixels, vision.grids)
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


@pytest.mark.parametrize("max_batch", [1, 4])
def test_engine_matches_mlx_vlm_generate_step(setup, max_batch):
    """The Engine's request (vision_prompt + submit) against mlx-vlm's own token loop."""
    path, ref, _, ours, tok = setup
    eng = Engine(ours, tok, keep_logprob_arrays=True, max_batch=max_batch)
    eng.image_preprocess = preprocessor_for(ours, path)
    images = [IMAGES["gray_webp"], IMAGES["exact_48"]]
    ids, vision = eng.vision_prompt(TWO, images)
    inp = _oracle(setup, TWO, images)
    want = vlm.generate(ref, mx.array([ids]), inp["pixel_values"], STEPS)
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
    # max_batch 4: a row of the L1 batch runner, not a request run alone
    assert eng.stats()["solo_reasons"] == ({"max_batch=1": 1} if max_batch == 1 else {})


def test_config_with_a_tower_but_no_tower_weights_loads_text_only(tmp_path):
    """A text-only conversion keeps the released vision_config but not the tower's weights:
    it loads as a text model (an image part is then refused as for any text model)."""
    import shutil
    src = ensure_fixture("float32")
    for f in src.iterdir():
        shutil.copy(f, tmp_path)
    w = mx.load(str(tmp_path / "model.safetensors"))
    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {k: v for k, v in w.items() if "language_model" in k})
    model, _ = load_model(tmp_path)
    assert model.vision is None and "vision_tower" not in model
    full, _ = load_model(src)
    x = mx.array([[2, 5, 100, 7]])
    assert mx.array_equal(model(x), full(x)).item()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def ple_setup(request):
    path = ensure_fixture(request.param, "ple")
    ref, processor = vlm.load(path)
    ours, _ = load_model(path)
    return path, ref, processor, ours, load_tokenizer(path)


def test_image_tokens_per_layer_inputs_as_token_0_matter(ple_setup):
    """Negative control (E2B-style decoder, the only one with per-layer inputs): looking an
    image token's per-layer input up by its own id, not as token 0, changes the prompt's
    logits (their equality with token 0 is test_logits_every_step_and_greedy_tokens)."""
    setup = ple_setup
    path, ref, _, ours, _ = setup
    assert ours.args.hidden_size_per_layer_input
    ids, vision = _ours(setup, ONE, [IMAGES["rgba_png"]])
    inp = _oracle(setup, ONE, [IMAGES["rgba_png"]])
    want, _ = vlm.forward_logits(ref, mx.array([ids]), inp["pixel_values"], 0)
    emb = ours.embed_prompt(ids, vision.pixels, vision.grids)
    media = ours.language_model.media_tokens
    assert ours.vision.image_token_id in media
    try:
        ours.language_model.set_media_tokens(())
        got = ours(mx.array([ids]), cache=ours.make_cache(), input_embeddings=emb)[0, -1]
    finally:
        ours.language_model.set_media_tokens(media)
    assert not mx.array_equal(got, want[0]).item()


def test_image_row_beside_a_text_row_matches_mlx_vlm(setup):
    """An image row and a text row in one batch: the image row's tokens and log-probabilities
    are still mlx-vlm's own; the text row runs to its end."""
    path, ref, _, ours, tok = setup
    eng = Engine(ours, tok, keep_logprob_arrays=True, max_batch=4)
    eng.image_preprocess = preprocessor_for(ours, path)
    images = [IMAGES["rgb_png"]]
    ids, vision = eng.vision_prompt(ONE, images)
    inp = _oracle(setup, ONE, images)
    want = vlm.generate(ref, mx.array([ids]), inp["pixel_values"], STEPS)
    eng.eos = set()
    text = tok.apply_chat_template([{"role": "user", "content": "hello there"}],
                                   add_generation_prompt=True)
    tid = eng.submit(text, SamplingParams(max_tokens=STEPS, temperature=0.0))
    rid = eng.submit(ids, SamplingParams(max_tokens=STEPS, temperature=0.0), vision=vision)
    toks, lps, other = [], [], 0
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None
            if o.request_id == rid:
                toks += o.token_ids
                lps += o.logprob_arrays
            else:
                assert o.request_id == tid
                other += len(o.token_ids)
    assert other == STEPS and toks == [t for t, _ in want]
    for i, (a, (_, b)) in enumerate(zip(lps, want)):
        assert mx.array_equal(a, b).item(), f"step {i}"
