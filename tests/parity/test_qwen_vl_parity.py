"""L1 of Qwen2.5-VL's image path against mlx-vlm 0.7.x (the live oracle), all with
`mx.array_equal`, on the `qwen2_5_vl` fixture (random weights in mlx-vlm's layout, float32
and bfloat16, `parity.fixtures.qwen2_5_vl`, and its 4- and 8-bit versions made by mlx-vlm's
converter: decoder quantized, tower float): the preprocessed pixel values, grids and
prompt ids, the vision tower's features, the merged embeddings and M-RoPE positions, the
logits at every step and the greedy tokens, and the Engine's request against mlx-vlm's own
`generate_step`. Negative controls: the M-RoPE sections swapped, one tower weight moved by
an ulp."""

import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from engine import Engine, SamplingParams
from engine.loader import load_model
from engine.models.qwen2_5_vl import prompt_positions
from engine.text.tokenizer import load_tokenizer
from engine.vision import preprocessor_for
from parity.fixtures.qwen2_5_vl import ensure_fixture
from parity.oracles import mlx_vlm_qwen_vl as vlm
from parity.oracles.mlx_vlm_oracle import quantized

pytestmark = pytest.mark.parity
STEPS = 10


def _enc(arr, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def _images() -> dict:
    rng = np.random.default_rng(11)
    exif = Image.Exif()
    exif[0x0112] = 6                      # orientation: rotate 90 degrees
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (37, 52, 3), dtype=np.uint8)).save(
        buf, "JPEG", exif=exif.tobytes())
    return {"rgb_png": _enc(rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)),   # rounded
            "large_png": _enc(rng.integers(0, 256, (150, 97, 3), dtype=np.uint8)),  # > max
            "small_rgba": _enc(rng.integers(0, 256, (12, 20, 4), dtype=np.uint8)),  # < min
            "gray_webp": _enc(rng.integers(0, 256, (9, 200), dtype=np.uint8), "WEBP"),
            "exif_jpeg": buf.getvalue(),
            "exact_bmp": _enc(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8), "BMP")}


IMAGES = _images()
ONE = [{"role": "user", "content": [{"type": "text", "text": "Describe this."},
                                    {"type": "image"}]}]
TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                    {"type": "image"}, {"type": "text", "text": "compare"}]}]


@pytest.fixture(scope="module", params=["float32", "bfloat16", "q4", "q8"])
def setup(request):
    if request.param in ("q4", "q8"):      # quantized by mlx-vlm's converter (tower float)
        path = quantized(ensure_fixture("bfloat16"), int(request.param[1]))
    else:
        path = ensure_fixture(request.param)
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


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixel_values_grid_and_ids_equal_the_processors(setup, name):
    ids, vision = _ours(setup, ONE, [IMAGES[name]])
    inp = _oracle(setup, ONE, [IMAGES[name]])
    assert vision.pixels.dtype == inp["pixel_values"].dtype == mx.float32
    assert mx.array_equal(vision.pixels, inp["pixel_values"]).item()
    assert [list(g) for g in vision.grids] == inp["image_grid_thw"].tolist()
    assert inp["input_ids"][0].tolist() == ids
    t, h, w = vision.grids[0]
    assert ids.count(setup[3].vision.image_token_id) == vision.tokens == t * h * w // 4
    assert 1024 <= h * w * 16 <= 4096 and h % 2 == w % 2 == 0


def test_features_embeddings_and_positions_equal(setup):
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, TWO, [IMAGES["large_png"], IMAGES["exif_jpeg"]])
    grid = mx.array([list(g) for g in vision.grids])
    got = ours.image_features(vision.pixels, vision.grids)
    want = vlm.features(ref, vision.pixels, grid)
    assert got.shape == (vision.tokens, 64) and mx.array_equal(got, want).item()
    emb, pos, delta = vlm.embeddings(ref, mx.array([ids]), vision.pixels, grid)
    assert mx.array_equal(ours.embed_prompt(ids, vision.pixels, vision.grids), emb).item()
    mine = prompt_positions(ids, ours.vision.image_token_id, vision.grids, 2)
    assert np.array_equal(np.array(pos)[:, 0], mine.table) and delta.item() == mine.delta < 0
    # the images do change the embeddings (a model that ignores them would fail above)
    assert not mx.array_equal(emb, ref.language_model.model.embed_tokens(mx.array([ids]))).item()


def _our_logits(ours, ids, vision, steps):
    cache = ours.make_cache()
    ours.bind_positions(cache, ids, vision.grids)
    emb = ours.embed_prompt(ids, vision.pixels, vision.grids)
    x = mx.array([ids])
    ours(x[:, :-1], cache=cache, input_embeddings=emb[:, :-1])
    out = ours(x[:, -1:], cache=cache, input_embeddings=emb[:, -1:])[0, -1]
    got, tokens = [out], []
    for _ in range(steps):
        tokens.append(mx.argmax(out).item())
        out = ours(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        got.append(out)
    return got, tokens


def test_logits_every_step_and_greedy_tokens(setup):
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, ONE, [IMAGES["rgb_png"]])
    grid = mx.array([list(g) for g in vision.grids])
    want, want_tokens = vlm.forward_logits(ref, mx.array([ids]), vision.pixels, grid, STEPS)
    got, tokens = _our_logits(ours, ids, vision, STEPS)
    assert tokens == want_tokens
    for i, (a, b) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), f"step {i}: max|diff| {mx.abs(a - b).max().item()}"


def test_text_only_prompt_equals_mlx_vlm(setup):
    """A prompt without images on the same model: plain positions (delta 0)."""
    _, ref, _, ours, tok = setup
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                  add_generation_prompt=True)
    vlm.reset(ref)
    lm, x = ref.language_model, mx.array([ids])
    cache, mine = vlm.make_cache(ref), ours.make_cache()
    want = [lm(x, cache=cache).logits[0, -1]]
    got = [ours(x, cache=mine)[0, -1]]
    for _ in range(4):
        t = mx.array([[mx.argmax(want[-1]).item()]])
        want.append(lm(t, cache=cache).logits[0, -1])
        got.append(ours(t, cache=mine)[0, -1])
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def test_engine_matches_mlx_vlm_generate_step(setup):
    """The Engine's request (vision_prompt + submit) against mlx-vlm's own token loop;
    with max_batch 4 it is a row of the batch, its own positions with it."""
    path, ref, _, ours, tok = setup
    eng = Engine(ours, tok, max_batch=4, keep_logprob_arrays=True)
    eng.image_preprocess = preprocessor_for(ours, path)
    ids, vision = eng.vision_prompt(TWO, [IMAGES["gray_webp"], IMAGES["small_rgba"]])
    grid = mx.array([list(g) for g in vision.grids])
    want = vlm.generate(ref, mx.array([ids]), vision.pixels, grid, STEPS)
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
    st = eng.stats()
    assert st["solo_reasons"] == {} and st["lanes"] == {"batch": 1, "solo": 0}


def test_negative_control_sections_swapped(setup, tmp_path):
    """The M-RoPE sections matter: the same checkpoint with [6, 6, 4] for [4, 6, 6] in its
    config changes the first logits."""
    import json
    import shutil

    path, ref, _, _, _ = setup
    ids, vision = _ours(setup, ONE, [IMAGES["rgb_png"]])
    grid = mx.array([list(g) for g in vision.grids])
    want, _ = vlm.forward_logits(ref, mx.array([ids]), vision.pixels, grid, 0)
    swapped = tmp_path / "swapped"
    shutil.copytree(path, swapped)
    cfg = json.loads((swapped / "config.json").read_text())
    cfg["rope_scaling"]["mrope_section"] = cfg["rope_scaling"]["mrope_section"][::-1]
    (swapped / "config.json").write_text(json.dumps(cfg))
    other, _ = load_model(swapped)
    got, _ = _our_logits(other, ids, vision, 0)
    assert not mx.array_equal(got[0], want[0]).item()


def test_negative_control_one_ulp(setup):
    """One tower weight moved by one ulp changes the features (the check can fail)."""
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, ONE, [IMAGES["exact_bmp"]])
    grid = mx.array([list(g) for g in vision.grids])
    want = vlm.features(ref, vision.pixels, grid)
    w = ours.vision_tower.blocks[0].attn.qkv.weight
    keep = w
    flat = np.array(w.astype(mx.float32)).reshape(-1)
    bumped = np.nextafter(flat[0], np.float32(np.inf), dtype=np.float32)
    if w.dtype == mx.bfloat16:
        bumped = flat[0] + abs(flat[0]) * 2 ** -7          # one bf16 ulp (or so)
    flat[0] = bumped
    try:
        ours.vision_tower.blocks[0].attn.qkv.weight = mx.array(flat.reshape(w.shape)).astype(w.dtype)
        assert not mx.array_equal(ours.vision_tower.blocks[0].attn.qkv.weight, keep).item()
        got = ours.image_features(vision.pixels, vision.grids)
    finally:
        ours.vision_tower.blocks[0].attn.qkv.weight = keep
    assert not mx.array_equal(got, want).item()
    assert mx.array_equal(ours.image_features(vision.pixels, vision.grids), want).item()


def test_negative_control_decode_delta(setup):
    """The positions after the prompt count from its largest position (delta < 0): with
    delta 0 the prompt's logits stay equal and the first decoded token's change."""
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, ONE, [IMAGES["rgb_png"]])
    grid = mx.array([list(g) for g in vision.grids])
    want, _ = vlm.forward_logits(ref, mx.array([ids]), vision.pixels, grid, 1)
    cache = ours.make_cache()
    ours.bind_positions(cache, ids, vision.grids)
    cache[0].mrope.delta = 0
    emb = ours.embed_prompt(ids, vision.pixels, vision.grids)
    x = mx.array([ids])
    ours(x[:, :-1], cache=cache, input_embeddings=emb[:, :-1])
    first = ours(x[:, -1:], cache=cache, input_embeddings=emb[:, -1:])[0, -1]
    second = ours(mx.array([[mx.argmax(first).item()]]), cache=cache)[0, -1]
    assert mx.array_equal(first, want[0]).item()
    assert not mx.array_equal(second, want[1]).item()


def test_text_rows_of_a_batch_equal_their_runs_alone():
    """Text-only requests on the model are rows of the continuous batch (per-row offsets);
    each row's tokens equal the same request run alone (CPU, float32)."""
    path = ensure_fixture("float32")
    ours, _ = load_model(path)
    tok = load_tokenizer(path)
    prompts = [[{"role": "user", "content": "Hello there"}],
               [{"role": "user", "content": "A much longer question about the weather today"}]]

    def run(max_batch, ps):
        eng = Engine(ours, tok, max_batch=max_batch)
        eng.eos = set()
        rids = [eng.submit(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in ps]
        out = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.token_ids
        return [out[r] for r in rids], eng.stats()["solo_reasons"]

    together, reasons = run(4, prompts)
    assert reasons == {}
    assert together == [run(1, [p])[0][0] for p in prompts]
