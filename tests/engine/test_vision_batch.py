"""Images in the continuous batch (issue #40): a request with images is a row of the L1
batch runner. Its prompt is prefilled from its merged embeddings (the text embeddings with
the images' features in place, as the alone path builds them; `engine.step.batch_vision`)
and it then decodes as any row, in the same decode forward as the text rows.

What is guaranteed, on the CPU gemma3 vision fixture (sliding window 16, one image = 16
image tokens, the image prompt 37 tokens):
- the image row's tokens and per-step logprob vectors equal the same request run alone
  (`max_batch=1`, the exact runner: today's path) with `mx.array_equal`, when it is the only
  row and with text rows prefilling and decoding beside it (float32 and bfloat16);
- the text rows' outputs are unchanged by the image row wherever the batch's logits are
  invariant on the CPU: in bfloat16 in these short runs (not always: a row joining mid-decode
  moved a long gemma3 bf16 row's logprobs after ~140 steps); in float32 when the text rows
  are longer than the sliding window and join together. What is not: float32 text rows shorter than the window beside a
  row longer than it (the image row, or any text row of its length) see the window's keys in
  another ring order and round differently (docs/batching.md, "Batch sensitivity"); the test
  checks that a text filler of the image prompt's length changes them just the same.
- the prompt cache still keys the row by the image digest: the same image reuses the KV
  (the tower is not run again), another image does not.
On the fast runner (tier l3) and in deterministic mode an image request still runs alone
(`solo_reasons["images"]`)."""

import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import engine.step.batch as batch_mod
from engine import Engine, PromptCache, SamplingParams
from engine.loader import load_model
from engine.step.batch import BatchRequest, BatchScheduler
from engine.text.tokenizer import load_tokenizer
from engine.vision import preprocessor_for
from starter.vision import ensure_vision_fixture

MSG = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]


def _png(seed) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 30, 3),
                                                         dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def vis(request):
    path = ensure_vision_fixture(request.param)
    model, _ = load_model(path)
    return request.param, path, model, load_tokenizer(path)


def _run(vis, max_batch, reqs, **kw):
    """reqs: ("img", seed, n) or ("txt", ids, n); -> ([(tokens, logprob arrays)], engine)."""
    _, path, model, tok = vis
    eng = Engine(model, tok, max_batch=max_batch, keep_logprob_arrays=True, **kw)
    eng.image_preprocess = preprocessor_for(model, path)
    eng.eos = set()                   # every request runs its max_tokens (a random model)
    rids = []
    for kind, what, n in reqs:
        p = SamplingParams(max_tokens=n, temperature=0.0)
        if kind == "img":
            ids, vision = eng.vision_prompt(MSG, [_png(what)])
            rids.append(eng.submit(ids, p, vision=vision))
        else:
            rids.append(eng.submit(what, p))
    out = {r: ([], []) for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprob_arrays)
    return [out[r] for r in rids], eng


def _same(a, b) -> bool:
    return (a[0] == b[0] and len(a[1]) == len(b[1])
            and all(mx.array_equal(x, y).item() for x, y in zip(a[1], b[1])))


def _texts(n):
    return [("txt", list(range(5, 5 + n)), 8), ("txt", list(range(40, 43 + n)), 6)]


def test_image_row_alone_in_the_batch_equals_the_request_run_alone(vis):
    (solo,), eng1 = _run(vis, 1, [("img", 1, 8)])
    assert eng1.stats()["solo_reasons"] == {"max_batch=1": 1}
    (row,), eng = _run(vis, 4, [("img", 1, 8)])
    assert len(row[0]) == 8 and _same(solo, row)
    st = eng.stats()
    assert st["solo_reasons"] == {} and st["lanes"] == {"batch": 1, "solo": 0}


@pytest.mark.parametrize("text_len", [4, 30])
def test_image_row_beside_text_rows(vis, text_len):
    """The image row decodes in the same forward as two text rows; it equals its alone run,
    and the text rows equal a batch without it where the CPU logits are batch-invariant."""
    dtype = vis[0]
    (solo,), _ = _run(vis, 1, [("img", 1, 8)])
    base, _ = _run(vis, 4, _texts(text_len))
    mixed, eng = _run(vis, 4, [_texts(text_len)[0], ("img", 1, 8), _texts(text_len)[1]])
    assert _same(solo, mixed[1])
    st = eng.stats()
    assert st["peak_rows"] == 3 and st["solo_reasons"] == {} and st["lanes"]["batch"] == 3
    invariant = dtype == "bfloat16" or text_len > 16        # (the sliding window: 16)
    assert (_same(base[0], mixed[0]) and _same(base[1], mixed[2])) == invariant
    if not invariant:   # the sliding ring's order, not the image: a text filler does the same
        ids, _ = eng.vision_prompt(MSG, [_png(1)])
        filler = ("txt", [7 + i % 50 for i in range(len(ids))], 8)
        ctl, _ = _run(vis, 4, [_texts(text_len)[0], filler, _texts(text_len)[1]])
        assert not _same(base[0], ctl[0]) and not _same(base[1], ctl[2])


def test_without_the_embeddings_the_row_differs(vis, monkeypatch):
    """Negative control: a batch that fed the image row its tokens' own embeddings (the
    features not merged in) gives other logits."""
    (solo,), _ = _run(vis, 1, [("img", 1, 8)])
    monkeypatch.setattr(batch_mod, "embedding_kwargs", lambda *a: {})
    (row,), _ = _run(vis, 4, [("img", 1, 8)])
    assert not mx.array_equal(solo[1][0], row[1][0]).item()


def test_prompt_cache_keyed_by_the_image_in_the_batch(vis, monkeypatch):
    _, path, model, tok = vis
    calls = []
    real = type(model).image_features
    monkeypatch.setattr(type(model), "image_features",
                        lambda self, *a: calls.append(1) or real(self, *a))
    eng = Engine(model, tok, max_batch=4, prompt_cache=PromptCache(1 << 26),
                 keep_logprob_arrays=True)
    eng.image_preprocess = preprocessor_for(model, path)
    eng.eos = set()

    def run(seed, beside=False):
        ids, vision = eng.vision_prompt(MSG, [_png(seed)])
        if beside:                          # (the prompt snapshot taken in a 2-row group)
            eng.submit(list(range(5, 25)), SamplingParams(max_tokens=6, temperature=0.0))
        rid = eng.submit(ids, SamplingParams(max_tokens=4, temperature=0.0), vision=vision)
        outs = []
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.request_id == rid]
        return ([t for o in outs for t in o.token_ids],
                [a for o in outs for a in o.logprob_arrays]), outs[-1].cached_tokens, len(ids)

    first, cached, n = run(1, beside=True)
    assert cached == 0 and len(calls) == 1
    again, cached, _ = run(1)
    assert cached == n - 1 and len(calls) == 1 and _same(first, again)
    _, cached, _ = run(2)                   # the same token ids, another image
    assert cached == 0 and len(calls) == 2
    assert eng.stats()["solo_reasons"] == {}


def test_deterministic_mode_keeps_images_alone(vis):
    (solo,), _ = _run(vis, 1, [("img", 1, 4)])
    (det,), eng = _run(vis, 4, [("img", 1, 4)], deterministic=True)
    assert eng.stats()["solo_reasons"] == {"images": 1}
    assert det[0] == solo[0]


def test_scheduler_checks_the_embeddings_length(vis):
    _, _, model, _ = vis
    sched = BatchScheduler(model)
    with pytest.raises(ValueError, match="embeddings for 2 tokens"):
        sched.submit(BatchRequest([1, 2, 3], embeddings=mx.zeros((1, 2, 64))))
