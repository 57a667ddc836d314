"""L1 of the `gemma4_unified` (encoder-free Gemma 4) image path against mlx-vlm 0.7.x: the
model patches, the vision_embedder + embed_vision soft tokens, the merged input embeddings,
the logits at every step and the greedy tokens, and the Engine's request against mlx-vlm's
own `generate_step`, all with `mx.array_equal`, on the `gemma4_unified_vision` fixture
(float32 and bfloat16, random weights in mlx-vlm's layout). A negative control: one
embedder weight moved by an ulp changes the soft tokens."""

import io
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from engine import Engine, SamplingParams
from engine.loader import load_model
from engine.text.tokenizer import load_tokenizer
from engine.vision import preprocessor_for
from parity.fixtures.gemma4_unified_vision import ensure_fixture
from parity.oracles import mlx_vlm_gemma4_unified as vlm

pytestmark = pytest.mark.parity
STEPS = 10


def _enc(arr, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


_rng = np.random.default_rng(12)
IMAGES = {"rgb_png": _enc(_rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)),
          "rgba_png": _enc(_rng.integers(0, 256, (40, 23, 4), dtype=np.uint8)),
          "gray_webp": _enc(_rng.integers(0, 256, (9, 200), dtype=np.uint8), "WEBP"),
          "exact_48": _enc(_rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)),
          "large": _enc(_rng.integers(0, 256, (300, 170, 3), dtype=np.uint8), "BMP")}
ONE = [{"role": "user", "content": [{"type": "text", "text": "Describe this."},
                                    {"type": "image"}]}]
TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                    {"type": "image"}, {"type": "text", "text": "compare"}]}]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def setup(request):
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
def test_patches_and_prompt_equal_the_processors(setup, name):
    ids, vision = _ours(setup, ONE, [IMAGES[name]])
    inp = _oracle(setup, ONE, [IMAGES[name]])
    (patches,) = vlm.patch_list(inp)
    assert patches.dtype == vision.pixels.dtype == mx.float32
    assert mx.array_equal(patches, vision.pixels).item()
    _, rows, cols = vision.grids[0]
    # the processor's positions: (column, row) of each model patch, row-major
    pos = inp["image_position_ids"][0, :rows * cols].tolist()
    assert pos == [[c, r] for r in range(rows) for c in range(cols)]
    assert inp["num_soft_tokens_per_image"].tolist() == [rows * cols] == [vision.tokens]
    bos = setup[4].bos_token_id                   # (mlx-vlm's processor adds a second <bos>)
    assert inp["input_ids"][0].tolist() == [bos] + ids
    assert ids.count(setup[3].vision.image_token_id) == rows * cols


def test_features_and_embeddings_equal(setup):
    _, ref, _, ours, _ = setup
    images = [IMAGES["rgb_png"], IMAGES["large"]]
    ids, vision = _ours(setup, TWO, images)
    inp = _oracle(setup, TWO, images)
    got = ours.image_features(vision.pixels, vision.grids)
    want = vlm.features(ref, inp)
    assert got.shape == (vision.tokens, 64) and mx.array_equal(got, want).item()
    e = vlm.embeddings(ref, mx.array([ids]), inp)
    assert mx.array_equal(ours.embed_prompt(ids, vision.pixels, vision.grids), e).item()
    plain = ref.language_model.model.embed_tokens(mx.array([ids])) * (64 ** 0.5)
    assert not mx.array_equal(e, plain).item()          # (the images do change them)


@pytest.mark.parametrize("where", ["patch_dense", "embed_vision"])
def test_one_ulp_in_the_embedder_changes_the_features(setup, where):
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, ONE, [IMAGES["rgb_png"]])
    inp = _oracle(setup, ONE, [IMAGES["rgb_png"]])
    emb = ours.vision_embedder
    owner = emb.patch_dense if where == "patch_dense" else ours.embed_vision.embedding_projection
    attr = "weight"
    saved = getattr(owner, attr)
    flat = saved.reshape(-1)
    bits = flat.view(mx.uint32 if saved.dtype == mx.float32 else mx.uint16)
    moved = mx.where(mx.arange(flat.size) == 0, bits + 1, bits).view(saved.dtype).reshape(saved.shape)
    assert not mx.array_equal(moved, saved).item()
    try:
        setattr(owner, attr, moved)
        got = ours.image_features(vision.pixels, vision.grids)
    finally:
        setattr(owner, attr, saved)
    want = vlm.features(ref, inp)
    assert not mx.array_equal(got, want).item()
    assert mx.array_equal(ours.image_features(vision.pixels, vision.grids), want).item()


def test_logits_every_step_and_greedy_tokens(setup):
    _, ref, _, ours, _ = setup
    ids, vision = _ours(setup, ONE, [IMAGES["rgba_png"]])
    inp = _oracle(setup, ONE, [IMAGES["rgba_png"]])
    want, want_tokens = vlm.forward_logits(ref, mx.array([ids]), inp, STEPS)
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
    path, ref, _, ours, tok = setup
    eng = Engine(ours, tok, keep_logprob_arrays=True, max_batch=max_batch)
    eng.image_preprocess = preprocessor_for(ours, path)
    images = [IMAGES["gray_webp"], IMAGES["exact_48"]]
    ids, vision = eng.vision_prompt(TWO, images)
    inp = _oracle(setup, TWO, images)
    want = vlm.generate(ref, mx.array([ids]), inp, STEPS)
    eng.eos = set()
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
    assert eng.stats()["solo_reasons"] == ({"max_batch=1": 1} if max_batch == 1 else {})


def _variant(tmp_path, edit):
    src = ensure_fixture("float32")
    for f in src.iterdir():
        shutil.copy(f, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_model(tmp_path)[0], load_tokenizer(tmp_path)


def test_checkpoints_not_served_refuse_images(tmp_path):
    from engine.step.request import PromptError
    from engine.vision import vision_prompt
    model, tok = _variant(tmp_path, lambda c: c["vision_config"].update(patch_size=3))
    with pytest.raises(PromptError, match="not supported"):
        vision_prompt(model, tok, ONE, [IMAGES["exact_48"]])


@pytest.mark.parametrize("edit", [
    lambda c: c["text_config"].pop("use_bidirectional_attention"),     # mlx-vlm: "vision"
    lambda c: c["text_config"].update(use_bidirectional_attention="vision")],
    ids=["bidirectional-default", "bidirectional"])
def test_bidirectional_checkpoints_take_images_whole(tmp_path, edit):
    """(their parity: tests/parity/test_gemma4_bidirectional_parity.py)"""
    from engine.vision import vision_prompt
    model, tok = _variant(tmp_path, edit)
    assert model.whole_image_prompts and model.language_model.image_blocks
    assert vision_prompt(model, tok, ONE, [IMAGES["exact_48"]])[0]


def test_text_only_unified_checkpoints_load_as_before():
    """The text fixture (no vision_config, a stub `vision_embedder`) stays text-only."""
    from starter.models import ensure_fixture as text_fixture
    model, _ = load_model(text_fixture("gemma4_unified"))
    assert model.vision is None and "vision_embedder" not in model
