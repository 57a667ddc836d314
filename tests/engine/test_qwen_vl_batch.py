"""Qwen2.5-VL images in the continuous batch: a request with images is a row of the L1 batch
runner although its M-RoPE positions are its own. Before every forward the runner puts each
row's positions on the group's first-layer batch cache (`engine.step.batch_vision`,
`bind_row_positions`); the model gives a text row offset + t on all three axes and the image
row its prompt's table while prefilling, offset + its delta while decoding, offsets counting
a row's real tokens only (left padding not counted).

On the CPU qwen2_5_vl fixture (full attention), with `mx.array_equal`:
- the image row's tokens and per-step logprob vectors equal the same request run alone
  (`max_batch=1`), alone in the batch and beside text rows that prefill and decode with it,
  shorter and longer than it, and when it joins while they decode;
- the text rows beside it equal a batch without it;
- negative control: the image row given plain positions (no `row_positions`) differs;
- the prompt cache keys the row by the image digest: the same image reuses the KV as a batch
  row (the tower not run again), a different question after the same image reuses the
  image prefix and equals its alone run, another image does not match."""

import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

import engine.step.batch as batch_mod
from engine import Engine, PromptCache, SamplingParams
from engine.loader import load_model
from engine.text.tokenizer import load_tokenizer
from engine.vision import preprocessor_for
from parity.fixtures.qwen2_5_vl import ensure_fixture


def _msg(text="What?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


TWO = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                    {"type": "image"}, {"type": "text", "text": "compare"}]}]


def _png(seed, shape=(40, 57, 3)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(
        buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def vis(request):
    path = ensure_fixture(request.param)
    model, _ = load_model(path)
    return request.param, path, model, load_tokenizer(path)


def _engine(vis, max_batch, **kw):
    _, path, model, tok = vis
    eng = Engine(model, tok, max_batch=max_batch, keep_logprob_arrays=True, **kw)
    eng.image_preprocess = preprocessor_for(model, path)
    eng.eos = set()                   # every request runs its max_tokens (a random model)
    return eng


def _submit(eng, kind, what, n):
    p = SamplingParams(max_tokens=n, temperature=0.0)
    if kind == "img":
        ids, vision = eng.vision_prompt(_msg(), [_png(what)])
        return eng.submit(ids, p, vision=vision)
    if kind == "two":
        ids, vision = eng.vision_prompt(TWO, [_png(what), _png(what + 1, (30, 20, 3))])
        return eng.submit(ids, p, vision=vision)
    return eng.submit(what, p)


def _run(vis, max_batch, reqs, later=(), after=3, **kw):
    """reqs (and `later`, submitted after `after` steps): ("img"|"two", seed, n) or
    ("txt", ids, n) -> ([(tokens, logprob arrays)] in order, engine)."""
    eng = _engine(vis, max_batch, **kw)
    rids = [_submit(eng, *r) for r in reqs]
    out, steps = {r: ([], []) for r in rids}, 0
    while eng.has_unfinished() or (later and steps <= after):
        if steps == after:
            for r in later:
                rids.append(_submit(eng, *r))
                out[rids[-1]] = ([], [])
        steps += 1
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(o.logprob_arrays)
    return [out[r] for r in rids], eng


def _same(a, b) -> bool:
    return (a[0] == b[0] and len(a[1]) == len(b[1])
            and all(mx.array_equal(x, y).item() for x, y in zip(a[1], b[1])))


def _texts(n):
    return [("txt", list(range(5, 5 + n)), 9), ("txt", list(range(40, 43 + n)), 6)]


@pytest.mark.parametrize("kind", ["img", "two"])
def test_image_row_alone_in_the_batch_equals_the_request_run_alone(vis, kind):
    (solo,), eng1 = _run(vis, 1, [(kind, 1, 8)])
    assert eng1.stats()["solo_reasons"] == {"max_batch=1": 1}
    (row,), eng = _run(vis, 4, [(kind, 1, 8)])
    assert len(row[0]) == 8 and _same(solo, row)
    st = eng.stats()
    assert st["solo_reasons"] == {} and st["lanes"] == {"batch": 1, "solo": 0}


@pytest.mark.parametrize("text_len,step", [(4, 2048), (70, 2048), (70, 16)])
def test_image_row_beside_text_rows(vis, text_len, step):
    """Text rows shorter (4) and longer (70 tokens) than the image prompt prefill and decode
    in the same forwards as the image row (left padding on either side); with 16-token
    prefill chunks the image row's prompt is prefilled over several of them."""
    kw = {"prefill_step_size": step}
    (solo,), _ = _run(vis, 1, [("two", 1, 8)], **kw)
    base, _ = _run(vis, 4, _texts(text_len), **kw)
    mixed, eng = _run(vis, 4, [_texts(text_len)[0], ("two", 1, 8), _texts(text_len)[1]], **kw)
    assert _same(solo, mixed[1])
    assert _same(base[0], mixed[0]) and _same(base[1], mixed[2])
    st = eng.stats()
    assert st["peak_rows"] == 3 and st["solo_reasons"] == {} and st["lanes"]["batch"] == 3


def test_rows_joining_while_others_decode(vis):
    """The image row joins while text rows decode, and a text row joins while it decodes."""
    (solo,), _ = _run(vis, 1, [("img", 2, 10)])
    t0, t1 = ("txt", list(range(9, 30)), 12), ("txt", list(range(60, 66)), 5)
    (b0,), _ = _run(vis, 4, [t0])
    (b1,), _ = _run(vis, 4, [t1])
    mixed, eng = _run(vis, 4, [t0, ("img", 2, 10)], later=[t1], after=4)
    assert _same(solo, mixed[1]) and _same(b0, mixed[0]) and _same(b1, mixed[2])
    assert eng.stats()["solo_reasons"] == {}


def test_plain_positions_change_the_image_row(vis, monkeypatch):
    """Negative control: a batch that gives the image row plain positions (its own never
    reach the model) gives it other logits; the text rows do not care."""
    (solo,), _ = _run(vis, 1, [("img", 1, 4)])
    base, _ = _run(vis, 4, _texts(4))
    monkeypatch.setattr(batch_mod, "bind_row_positions", lambda *a: None)
    mixed, _ = _run(vis, 4, [_texts(4)[0], ("img", 1, 4), _texts(4)[1]])
    assert not mx.array_equal(solo[1][0], mixed[1][1][0]).item()
    assert _same(base[0], mixed[0]) and _same(base[1], mixed[2])


def test_prompt_cache_by_image_digest_in_the_batch(vis, monkeypatch):
    _, path, model, tok = vis
    calls = []
    real = type(model).image_features
    monkeypatch.setattr(type(model), "image_features",
                        lambda self, *a: calls.append(1) or real(self, *a))
    eng = _engine(vis, 4, prompt_cache=PromptCache(1 << 26))

    def run(seed, text="What?", beside=True):
        ids, vision = eng.vision_prompt(_msg(text), [_png(seed)])
        if beside:
            eng.submit(list(range(5, 25)), SamplingParams(max_tokens=6, temperature=0.0))
        rid = eng.submit(ids, SamplingParams(max_tokens=5, temperature=0.0), vision=vision)
        outs = []
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.request_id == rid]
        return ([t for o in outs for t in o.token_ids],
                [a for o in outs for a in o.logprob_arrays]), outs[-1].cached_tokens, ids

    first, cached, ids = run(1)
    assert cached == 0 and len(calls) == 1
    again, cached, _ = run(1)
    assert cached == len(ids) - 1 and len(calls) == 1 and _same(first, again)
    other, cached, ids2 = run(1, "Tell me more about the colours, please.")
    assert 0 < cached < len(ids2) - 1 and len(calls) == 1     # the image prefix reused
    solo_eng = _engine(vis, 1)
    i2, v2 = solo_eng.vision_prompt(_msg("Tell me more about the colours, please."), [_png(1)])
    assert i2 == ids2
    rid = solo_eng.submit(i2, SamplingParams(max_tokens=5, temperature=0.0), vision=v2)
    want = ([], [])
    while solo_eng.has_unfinished():
        for o in solo_eng.step():
            want[0].extend(o.token_ids)
            want[1].extend(o.logprob_arrays)
    assert _same(want, other) and len(calls) == 2      # (the alone run's tower)
    _, cached, _ = run(2)                   # the same token ids, another image
    assert cached == 0 and len(calls) == 3
    assert eng.stats()["solo_reasons"] == {}
