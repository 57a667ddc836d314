"""A request that runs alone (prefix caches; adapters on the fast runner) runs beside the batch.

Each Engine.step runs one unit of the request running alone (a prefill chunk or a token) and
one step of the batch: the batch keeps decoding, later batch requests keep joining, and
every request's tokens equal those of the same request run by itself (greedy). A request
sampling from the global seeded stream (seed, temperature > 0) still runs only once the
batch has drained, so its output does not depend on other traffic.
"""

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.levers import parse_spec
from parity.fixtures.models import ensure_fixture
from tests.server.srv_helpers import make_adapter


@pytest.fixture(scope="module")
def qwen_path():
    return str(ensure_fixture("qwen3", "bfloat16"))


def _run(eng, plan):
    """plan: [(submit at step, prompt, params, kwargs)] -> (tokens per request, the step each
    request emitted its first and last output, the steps at which each produced output)."""
    rids, toks, seen = {}, {}, {}
    step = 0
    while step <= max(p[0] for p in plan) or eng.has_unfinished():
        for k, (at, prompt, params, kw) in enumerate(plan):
            if at == step:
                rids[k] = eng.submit(prompt, params, **kw)
                toks[rids[k]], seen[rids[k]] = [], []
        for o in eng.step():
            toks[o.request_id] += o.token_ids
            seen[o.request_id].append(step)
        step += 1
    return [toks[rids[k]] for k in range(len(plan))], [seen[rids[k]] for k in range(len(plan))]


def _alone(model, tok, prompt, params, **kw):
    eng = Engine(model, tok, max_batch=4, adapters=kw.pop("adapters", None))
    return _run(eng, [(0, prompt, params, kw)])[0][0]


def test_an_adapter_request_runs_beside_the_fast_batch(qwen_path, tmp_path):
    """On the fast runner a request with adapters runs alone, beside the rows (on the L1 batch
    runner it is a row itself: tests/engine/test_adapter_rows.py)."""
    eng = Engine.load(qwen_path, max_batch=4, levers=parse_spec("l3"))
    eng.adapters.mount("a", str(make_adapter(qwen_path, tmp_path / "a", seed=1)))
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    short = SamplingParams(max_tokens=8, temperature=0.0)
    plan = [(0, "one two three", greedy, {}), (0, "alpha beta", greedy, {}),
            (2, "the adapter's turn", short, {"adapter": ("a",)}),
            (4, "a later batch request", short, {})]
    out, seen = _run(eng, plan)
    assert eng.stats()["solo_reasons"] == {"adapters": 1}
    # the adapter request finished while the first batch rows were still decoding, and the
    # batch request submitted after it did not wait for it
    assert seen[2][-1] < seen[0][-1] and seen[2][-1] < seen[1][-1]
    assert seen[3][0] < seen[2][-1]
    assert eng.stats()["peak_rows"] >= 3
    traces = eng.stats()["fast"]["traces"]
    _run(eng, plan)                      # the same traffic again: adapters switched on and
    assert eng.stats()["fast"]["traces"] == traces    # off every step, no new trace


def test_prefix_cache_request_runs_beside_the_batch(qwen_path):
    model, tok = engine.load(qwen_path)
    head = tok.encode("a shared beginning of the prompt")
    caches = model.make_cache()
    mx.eval(model(mx.array(head)[None], cache=caches))
    eng = Engine(model, tok, max_batch=4)
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    plan = [(0, "one two three", greedy, {}),
            (1, tok.encode(" and its end"), SamplingParams(max_tokens=6, temperature=0.0),
             {"prefix_caches": caches})]
    out, seen = _run(eng, plan)
    assert eng.stats()["solo_reasons"] == {"prefix_caches": 1}
    assert seen[1][-1] < seen[0][-1]
    assert out[0] == _alone(model, tok, "one two three", greedy)


def _prefix(model, tok, text):
    caches = model.make_cache()
    mx.eval(model(mx.array(tok.encode(text))[None], cache=caches))
    return caches


def test_seeded_sampling_alone_waits_for_the_batch_and_stays_reproducible(qwen_path):
    model, tok = engine.load(qwen_path)
    eng = Engine(model, tok, max_batch=4)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    noisy = SamplingParams(max_tokens=12, temperature=1.0)
    alone_kw = {"prefix_caches": _prefix(model, tok, "a shared beginning")}
    plan = [(0, "one two three", noisy, {}), (0, "alpha", noisy, {}),
            (1, tok.encode(" the seeded one"), seeded, alone_kw),
            (2, "after it", SamplingParams(max_tokens=4, temperature=0.0), {})]
    out, seen = _run(eng, plan)
    # it started after the batch drained; the batch request after it waited for it
    assert seen[2][0] > max(seen[0][-1], seen[1][-1])
    assert seen[3][0] > seen[2][0]
    alone = Engine(model, tok, max_batch=4)
    again = {"prefix_caches": _prefix(model, tok, "a shared beginning")}
    assert out[2] == _run(alone, [(0, plan[2][1], seeded, again)])[0][0]
