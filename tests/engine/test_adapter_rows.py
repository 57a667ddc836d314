"""Requests with different runtime adapters decode as rows of one batch (engine.adapters.rows).

Each row gets exactly its own adapters in the batch's forward (a row mask per adapter), so on
the CPU, where a row's values do not depend on the other rows of a forward, every row's tokens
and logprobs equal the same request run by itself with its adapters switched on; rows without
adapters equal the base model's. On the fast runner (`--tier l3`) a request with adapters still
runs alone (tests/engine/test_lanes_side_by_side.py)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

import engine.adapters.rows as rows_mod
from engine import Engine, SamplingParams
from engine.adapters.lora import LoRALinear
from engine.adapters.rows import selected
from parity.fixtures.models import ensure_fixture
from tests.server.srv_helpers import make_adapter

PLAN = [(0, "one two three four", ()), (0, "alpha beta", ("a",)),
        (1, "the second adapter's turn", ("b",)), (2, "both of them now", ("a", "b")),
        (3, "a late base request", ())]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = str(ensure_fixture("qwen3", "float32"))
    d = tmp_path_factory.mktemp("adapters")
    return path, make_adapter(path, d / "a", seed=1), make_adapter(path, d / "b", seed=2)


def _engine(qwen, max_batch):
    path, a, b = qwen
    eng = Engine.load(path, max_batch=max_batch, prompt_cache=None)
    eng.adapters.mount("a", str(a))
    eng.adapters.mount("b", str(b))
    return eng


def _run(eng, plan):
    """Each request's (tokens, logprob dicts) and the steps at which it produced output."""
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, top_logprobs=5)
    rids, out, step = {}, {}, 0
    while step <= max(p[0] for p in plan) or eng.has_unfinished():
        for k, (at, prompt, ad) in enumerate(plan):
            if at == step:
                rids[k] = eng.submit(prompt, params, adapter=ad)
                out[rids[k]] = ([], [], [])
        for o in eng.step():
            toks, lps, seen = out[o.request_id]
            toks += o.token_ids
            lps += o.logprobs
            seen.append(step)
        step += 1
    return [out[rids[k]] for k in range(len(plan))]


def test_adapter_rows_decode_together_and_equal_each_request_alone(qwen):
    eng = _engine(qwen, 8)
    got = _run(eng, PLAN)
    st = eng.stats()
    assert "adapters" not in st["solo_reasons"]        # every request was a batch row
    assert st["peak_rows"] >= 4                          # base and adapter rows in one forward
    for k, (_, prompt, ad) in enumerate(PLAN):
        alone = _run(_engine(qwen, 1), [(0, prompt, ad)])[0]    # the exact runner
        assert got[k][0] == alone[0], (k, ad)
        assert got[k][1] == alone[1], (k, ad)                  # logprobs, as floats
    base = [_run(_engine(qwen, 1), [(0, p, ())])[0][0] for _, p, _ in PLAN]
    assert all((got[k][0] != base[k]) == bool(ad) for k, (_, _, ad) in enumerate(PLAN))


def test_negative_control_without_row_masks(qwen, monkeypatch):
    """With the selection ignored the batch runs the adapters' global switches (all off for
    the batch): the adapter rows come out as the base model's, and the test above would fail."""
    monkeypatch.setattr(rows_mod, "row_mask", lambda name, ndim: None)
    monkeypatch.setattr("engine.adapters.lora.row_mask", lambda name, ndim: None)
    got = _run(_engine(qwen, 8), PLAN)
    alone = _run(_engine(qwen, 1), [(0, PLAN[1][1], ("a",))])[0]
    assert got[1][0] != alone[0]


def test_lora_linear_row_selection_is_exact():
    mx.random.seed(0)
    lin = LoRALinear(nn.Linear(16, 8), rank=4, scale=2.0, primary_name="p")
    lin.lora_a = mx.random.normal((16, 4))
    lin.lora_b = mx.random.normal((4, 8))
    lin._stack.items.append({"name": "s", "a": mx.random.normal((16, 2)),
                             "b": mx.random.normal((2, 8)), "scale": 0.5, "active": False})
    lin.enabled = False
    x = mx.random.normal((3, 5, 16))
    base = lin.linear(x)
    with selected([("p",), (), ("p", "s")]):
        y = lin(x)
    lin.enabled = True
    only_p = lin(x)
    lin._stack.items[0]["active"] = True
    both = lin(x)
    assert mx.array_equal(y[0], only_p[0]) and mx.array_equal(y[1], base[1])
    assert mx.array_equal(y[2], both[2])
    assert not mx.array_equal(y[0], base[0]) and not mx.array_equal(y[2], only_p[2])
    lin.enabled = False
    lin._stack.items[0]["active"] = False
    assert mx.array_equal(lin(x), base)                 # outside a selection: the switches


def test_a_request_for_an_adapter_unmounted_meanwhile_is_refused_by_name(qwen):
    """The server resolves `adapter` when the request arrives; an unmount queued before it
    runs first. The request is then a 400 naming the adapter and the field, not a bare
    KeyError ("'a'")."""
    from engine.adapters.registry import UnknownAdapter

    eng = _engine(qwen, 8)
    eng.adapters.unmount("a")
    with pytest.raises(UnknownAdapter) as e:
        eng.submit("x", SamplingParams(max_tokens=2), adapter=("b", "a"))
    assert e.value.param == "adapter" and 'adapter "a"' in str(e.value)
    assert not eng.has_unfinished()
