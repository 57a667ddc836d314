"""L1 of Gemma 4's bidirectional attention within images (`text_config.
use_bidirectional_attention: "vision"`) against mlx-vlm 0.7.x: the `gemma4_vision` and
`gemma4_unified_vision` fixtures with the config set to "vision"; mlx-vlm prefills such a prompt in one forward whose masks
let each image's tokens attend to each other both ways. The logits at every step and the
greedy tokens, and the Engine's request against mlx-vlm's `generate_step` (given the
prompt's `mm_token_type_ids`, as `mlx_vlm.generate` passes the processor's), with
`mx.array_equal`; a negative control: without the overlay mlx-vlm's logits differ."""

import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from engine import Engine, PromptCache, SamplingParams
from engine.step.core import BASE_NAMESPACE
from engine.loader import load_model
from engine.text.tokenizer import load_tokenizer
from engine.vision import preprocessor_for
from parity.fixtures import gemma4_unified_vision, gemma4_vision
from parity.oracles import mlx_vlm_gemma4 as vlm
from parity.oracles import mlx_vlm_gemma4_unified as vlm_unified

pytestmark = pytest.mark.parity
STEPS = 8


def _enc(arr) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


_rng = np.random.default_rng(5)
IMAGES = [_enc(_rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)),
          _enc(_rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))]
TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                    {"type": "image"}, {"type": "text", "text": "compare"}]}]


@pytest.fixture(scope="module", params=[("gemma4", "float32", "dense"),
                                        ("gemma4", "float32", "ple"),
                                        ("gemma4", "bfloat16", "dense"),
                                        ("gemma4_unified", "float32"),
                                        ("gemma4_unified", "bfloat16")],
                ids=lambda p: "-".join(p))
def setup(request, tmp_path_factory):
    family, *args = request.param
    fixtures = gemma4_vision if family == "gemma4" else gemma4_unified_vision
    path = gemma4_vision.bidirectional_copy(fixtures.ensure_fixture(*args),
                                            tmp_path_factory.mktemp("g4bi"))
    ref, processor = (vlm if family == "gemma4" else vlm_unified).load(path)
    assert ref.language_model.config.use_bidirectional_attention == "vision"
    ours, _ = load_model(path)
    assert ours.whole_image_prompts
    return path, ref, processor, ours, load_tokenizer(path)


def _prompt(setup):
    path, ref, processor, ours, tok = setup
    eng = Engine(ours, tok)
    eng.image_preprocess = preprocessor_for(ours, path)
    ids, vision = eng.vision_prompt(TWO, IMAGES)
    text = tok.apply_chat_template(TWO, tokenize=False, add_generation_prompt=True)
    inp = vlm.prepare(ref, processor, IMAGES, text)
    assert inp["input_ids"][0].tolist()[1:] == ids     # (its processor adds a second <bos>)
    kw = {k: inp[k] for k in ("image_position_ids",) if k in inp}    # (gemma4_unified)
    return ids, vision, inp["pixel_values"], kw


def _ours(ours, ids, vision) -> tuple:
    cache = ours.make_cache()
    emb = ours.embed_prompt(ids, vision.pixels, vision.grids)
    out = ours(mx.array([ids]), cache=cache, input_embeddings=emb)[0, -1]
    got, tokens = [out], []
    for _ in range(STEPS):
        tokens.append(mx.argmax(out).item())
        out = ours(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        got.append(out)
    return got, tokens


def test_logits_every_step_and_greedy_tokens(setup):
    _, ref, _, ours, _ = setup
    ids, vision, pixels, kw = _prompt(setup)
    want, want_tokens = vlm.whole_forward_logits(ref, mx.array([ids]), pixels, STEPS, **kw)
    got, tokens = _ours(ours, ids, vision)
    assert tokens == want_tokens
    for i, (a, b) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), f"step {i}: max|diff| {mx.abs(a - b).max().item()}"


def test_without_the_overlay_the_logits_differ(setup):
    """Negative control: mlx-vlm's same forward without the token types (causal masks)."""
    _, ref, _, ours, _ = setup
    ids, vision, pixels, kw = _prompt(setup)
    causal, _ = vlm.whole_forward_logits(ref, mx.array([ids]), pixels, 0, types=False, **kw)
    got, _ = _ours(ours, ids, vision)
    assert not mx.array_equal(got[0], causal[0]).item()
    # and ours without the blocks is mlx-vlm's causal forward
    blocks = ours.language_model.image_blocks
    ours.language_model.set_image_blocks(())
    try:
        plain, _ = _ours(ours, ids, vision)
    finally:
        ours.language_model.set_image_blocks(blocks)
    assert mx.array_equal(plain[0], causal[0]).item()


@pytest.mark.parametrize("max_batch", [1, 4])
def test_engine_matches_mlx_vlm_generate_step(setup, max_batch):
    path, ref, _, ours, tok = setup
    ids, vision, pixels, kw = _prompt(setup)
    want = vlm.generate_with_types(ref, mx.array([ids]), pixels, STEPS, **kw)
    eng = Engine(ours, tok, keep_logprob_arrays=True, max_batch=max_batch)
    eng.image_preprocess = preprocessor_for(ours, path)
    eng.eos = set()
    for _ in range(2):              # the second: the same (no prompt cache on this engine)
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
    # (a batching engine: a row of the batch, its prompt but the last token run in one forward)
    assert eng.stats()["solo_reasons"] == ({"max_batch=1": 2} if max_batch == 1 else {})


def test_image_request_beside_text_rows_and_text_unchanged(setup):
    """max_batch 4: an image request submitted among text requests is a row of their batch and
    still equals mlx-vlm; the text rows equal themselves run without it; a text prompt's logits
    are those of the causal checkpoint (no image token, no overlay)."""
    path, ref, _, ours, tok = setup
    ids, vision, pixels, kw = _prompt(setup)
    want = vlm.generate_with_types(ref, mx.array([ids]), pixels, STEPS, **kw)
    eng = Engine(ours, tok, keep_logprob_arrays=True, max_batch=4)
    eng.image_preprocess = preprocessor_for(ours, path)
    eng.eos = set()
    text = [2] + list(range(40, 70))
    params = SamplingParams(max_tokens=STEPS, temperature=0.0)
    first = eng.submit(text, params)
    rid = eng.submit(ids, params, vision=vision)
    last = eng.submit(text[:20], params)
    got = {first: [], rid: [], last: []}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None
            got[o.request_id] += o.logprob_arrays
    assert len(got[rid]) == STEPS
    for i, (a, (_, b)) in enumerate(zip(got[rid], want)):
        assert mx.array_equal(a, b).item(), f"step {i}"
    assert eng.stats()["solo_reasons"] == {}
    alone = Engine(ours, tok, keep_logprob_arrays=True, max_batch=4)
    alone.eos = set()
    a, b = alone.submit(text, params), alone.submit(text[:20], params)
    want_text = {a: [], b: []}
    while alone.has_unfinished():
        for o in alone.step():
            want_text[o.request_id] += o.logprob_arrays
    for mine, ref_rid in ((first, a), (last, b)):
        assert len(got[mine]) == STEPS
        assert all(mx.array_equal(x, y).item() for x, y in zip(got[mine], want_text[ref_rid]))
    blocks = ours.language_model.image_blocks
    with_blocks = ours(mx.array([text]))
    ours.language_model.set_image_blocks(())
    try:
        assert mx.array_equal(with_blocks, ours(mx.array([text]))).item()
    finally:
        ours.language_model.set_image_blocks(blocks)


def _drain(eng, rid) -> tuple:
    toks, lps, out = [], [], None
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == rid and o.error is None
            toks += o.token_ids
            lps += o.logprob_arrays
            out = o
    return toks, lps, out


@pytest.mark.parametrize("max_batch", [1, 4])
def test_prompt_cache_hit_past_the_images(setup, max_batch):
    """The next turn of a conversation with the same images (the whole first prompt, the answer
    and more text) reuses the first request's KV: its tokens and logprobs equal mlx-vlm's
    model run on that schedule (the whole forward, the answer's tokens, the new text on the
    cache), and the vision tower does not run again."""
    path, ref, _, ours, tok = setup
    ids, vision, pixels, kw = _prompt(setup)
    eng = Engine(ours, tok, keep_logprob_arrays=True, max_batch=max_batch,
                 prompt_cache=PromptCache(1 << 28))
    eng.image_preprocess = preprocessor_for(ours, path)
    eng.eos = set()
    params = SamplingParams(max_tokens=STEPS, temperature=0.0)
    first, _, out = _drain(eng, eng.submit(ids, params, vision=vision))
    assert out.cached_tokens == 0
    more = list(range(40, 52))
    tower = type(ours).image_features
    calls = []
    type(ours).image_features = lambda self, *a: calls.append(1) or tower(self, *a)
    try:
        toks, lps, out = _drain(eng, eng.submit(ids + first + more, params, vision=vision))
    finally:
        type(ours).image_features = tower
    # (the answer's tokens fed: all but the last on a batch row, all alone: generate_step's)
    reused = out.cached_tokens
    assert len(ids) + STEPS - 1 <= reused <= len(ids) + STEPS and calls == []
    turn = ids + first + more
    want_lps, want = vlm.whole_then_cached(ref, mx.array([ids]), pixels, turn[len(ids):reused],
                                           turn[reused:], STEPS, **kw)
    assert toks == want
    for i, (a, b) in enumerate(zip(lps, want_lps)):
        assert mx.array_equal(a, b).item(), f"step {i}: max|diff| {mx.abs(a - b).max().item()}"


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_hit_inside_an_image_is_not_taken(setup, max_batch):
    """A cached prefix that ends inside an image (here stored by hand, holding the causal
    forward's KV) would leave image tokens to prefill on a cache, where they cannot attend to
    their whole image: the engine drops that hit (the cache offers it) and runs the prompt
    whole, equal to mlx-vlm."""
    path, ref, _, ours, tok = setup
    ids, vision, pixels, kw = _prompt(setup)
    cache = PromptCache(1 << 28)
    eng = Engine(ours, tok, keep_logprob_arrays=True, max_batch=max_batch, prompt_cache=cache)
    eng.image_preprocess = preprocessor_for(ours, path)
    eng.eos = set()
    image = ours.vision.image_token_id
    cut = max(i for i, t in enumerate(ids) if t == image)       # inside the last image
    assert ids[cut - 1] == image
    caches = ours.make_cache()
    emb = ours.embed_prompt(ids, vision.pixels, vision.grids)[:, :cut]
    ours(mx.array([ids[:cut]]), cache=caches, input_embeddings=emb)
    ns = f"{BASE_NAMESPACE}:images:{vision.digest}"
    cache.store(ns, ids[:cut], caches)
    assert cache.fetch(ns, ids).reused == cut                  # offered...
    toks, lps, out = _drain(eng, eng.submit(ids, SamplingParams(max_tokens=STEPS,
                                                                temperature=0.0), vision=vision))
    assert out.cached_tokens == 0                             # ...and not taken
    want = vlm.generate_with_types(ref, mx.array([ids]), pixels, STEPS, **kw)
    assert toks == [t for t, _ in want]
    for i, (a, (_, b)) in enumerate(zip(lps, want)):
        assert mx.array_equal(a, b).item(), f"step {i}"
