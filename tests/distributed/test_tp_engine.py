"""`Engine.load(path, tensor_parallel=True)` from a library script (no server): under
`mlx.launch -n 2 --backend ring`, rank 0's engine gives exactly the tokens of a
single-process Engine on the unsharded model (greedy and seeded, batched, with a
cancellation), and of `engine.generate` on the sharded model in the same launch; rank 1
follows inside `Engine.load` and ends with status 0 when rank 0 closes its engine. In one
process (a world of one rank) the engine is the same Engine driven through the leader,
and a lost rank is a `RankLost` raised by `step()`."""

import json

import pytest

from engine import Engine, SamplingParams
from engine.distributed import Leader, RankLost
from parity.fixtures.models import ensure_fixture
from parity.launch import launch
from tests.distributed.drive import drive

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:"]
SPEC = ([{"prompt": p, "max_tokens": 12, "temperature": 0.0} for p in PROMPTS]
        + [{"prompt": "print(", "max_tokens": 12, "temperature": 0.8, "seed": 7}])


@pytest.fixture(scope="module")
def model_dir():
    return ensure_fixture("llama", "float32", variant="tp2")


def _single_process(model_dir, spec=SPEC, **load):
    """Each request's token ids and finish reason from a plain Engine (max_batch 2)."""
    eng = Engine.load(model_dir, max_batch=2, **load)
    rids = [eng.submit(r["prompt"], SamplingParams(max_tokens=r["max_tokens"],
                                                   temperature=r["temperature"],
                                                   seed=r.get("seed"))) for r in spec]
    got = drive(eng, rids)
    return eng, [t for t, _ in got], [e for _, e in got]


def test_library_script_under_launch_equals_single_process_engine(model_dir, tmp_path):
    r = launch("tests/distributed/engine_worker.py", [model_dir, json.dumps(SPEC)], tmp_path,
               n=2, timeout=120)
    assert r.returncode == 0, r.output[-4000:]
    r0, r1 = r.ranks
    assert r0 is not None and r1 is not None, r.output[-4000:]
    assert (r0["size"], r1["size"]) == (2, 2)
    assert r0["type"] == "Leader" and r1["exit"] == 0 and "tokens" not in r1
    _, tokens, ends = _single_process(model_dir)
    assert all(t for t in tokens) and ends == ["length"] * len(SPEC)
    assert r0["tokens"] == tokens and r0["ends"] == ends
    # the same greedy tokens as engine.generate on the sharded model, on both ranks
    assert r0["reference"] == r1["reference"] == tokens[:len(PROMPTS)]
    assert r0["cancelled"] == "cancelled" and r0["peak_rows"] == 2


def test_one_rank_engine_is_the_engine_through_the_leader(model_dir, monkeypatch):
    import engine.distributed.sharding as sharding
    sent = []

    def broadcast(obj=None, group=None):
        sent.append(obj)
        return obj
    monkeypatch.setattr(sharding, "broadcast_json", broadcast)
    plain, tokens, ends = _single_process(model_dir)
    tp, tp_tokens, tp_ends = _single_process(model_dir, tensor_parallel=True)
    assert isinstance(tp, Leader) and not isinstance(plain, Leader)
    assert (tp_tokens, tp_ends) == (tokens, ends)
    subs = [op for m in sent[1:] for op in m["ops"] if op["kind"] == "submit"]
    assert sent[0] == tp.admission.budget_bytes          # rank 0's memory budget
    assert [s["params"]["seed"] for s in subs] == [None, None, None, 7]
    assert {m["kind"] for m in sent[1:]} == {"step", "ping"}
    tp.close()
    assert sent[-1]["kind"] == "stop" and not tp.has_unfinished()
    tp.close()                                            # once
    assert sum(isinstance(m, dict) and m["kind"] == "stop" for m in sent) == 1


def test_one_rank_engine_raises_rank_lost(model_dir, monkeypatch, capsys):
    import engine.distributed.sharding as sharding
    eng = Engine.load(model_dir, tensor_parallel=True)
    eng.submit("def add(a, b):", SamplingParams(max_tokens=4, temperature=0.0))

    def gone(obj=None, group=None):
        raise RuntimeError("[ring] connection to a peer was lost")
    monkeypatch.setattr(sharding, "broadcast_json", gone)
    with pytest.raises(RankLost, match=r"\[ring\] connection to a peer was lost"):
        eng.step()
    assert "engine: tensor parallel: lost a rank: [ring]" in capsys.readouterr().err
    assert not eng.has_unfinished()
    with pytest.raises(RankLost):
        eng.submit("x", SamplingParams(max_tokens=1))
    eng.close()                                           # nothing left to stop
