"""L1 under `mlx.launch -n 2 --backend ring`: our tensor-parallel model equals mlx-lm's
`sharded_load` model, logits at every prefill/decode step and greedy tokens, bitwise."""

import mlx.core as mx
import pytest

from engine.loader import load_model
from engine.distributed.sharding import ShardingError, shard_model
from parity.fixtures.models import ensure_fixture
from parity.launch import launch

pytestmark = pytest.mark.parity

SPECS = [("llama", "float32"), ("llama", "q8"), ("qwen3", "bfloat16"), ("qwen3", "q4")]


def test_tensor_parallel_equals_mlx_lm_sharded_load(tmp_path):
    for fam, dt in SPECS:  # build before the ranks start, not twice in parallel
        ensure_fixture(fam, dt, variant="tp2")
    r = launch("tests/distributed/tp_worker.py", [f"{f}:{d}" for f, d in SPECS], tmp_path,
               n=2, timeout=90)
    assert r.returncode == 0, r.output[-4000:]
    assert [x["size"] for x in r.ranks] == [2, 2]
    for rank in r.ranks:
        for res in rank["results"]:
            name = f"rank {rank['rank']} {res['family']}/{res['dtype']}"
            assert all(res["logits_equal"]) and len(res["logits_equal"]) == 6, name
            assert res["our_tokens"] == res["ref_tokens"], name
            # really sharded: half the heads per rank, MLX's sharded layers in place
            assert (res["n_heads_per_rank"], res["n_kv_heads_per_rank"]) == (2, 1), name
            assert res["q_proj"].endswith("AllToShardedLinear"), name
            assert res["down_proj"].endswith("ShardedToAllLinear"), name
    # both ranks hold the same full logits, so they agree on every token
    assert r.ranks[0]["results"] == r.ranks[1]["results"]
    # rank 0's request reaches every rank intact
    assert [x["broadcast"] for x in r.ranks] == [{"prompt": "héllo wörld", "max_tokens": 3}] * 2


def test_single_rank_broadcast_is_identity():
    from engine.distributed.sharding import broadcast_json
    obj = {"a": [1, 2]}
    assert broadcast_json(obj) is obj


def test_single_rank_sharding_is_identity():
    model = load_model(ensure_fixture("qwen3"))[0]
    x = mx.array([[1, 2, 3, 4]])
    before = model(x)
    plan = shard_model(model)
    assert plan.world_size == 1 and plan.n_heads == 2
    assert mx.array_equal(before, model(x))


@pytest.mark.parametrize("family", ["minicpm", "gemma4_text"])
def test_unsupported_family_is_refused(family):
    model = load_model(ensure_fixture(family), lazy=True)[0]
    with pytest.raises(ShardingError, match="tensor parallelism supports"):
        shard_model(model)


def test_heads_that_do_not_split_are_refused():
    from engine.distributed.sharding import check_shardable
    model = load_model(ensure_fixture("llama"), lazy=True)[0]  # 1 KV head
    with pytest.raises(ShardingError, match="key/value heads do not split over 2"):
        check_shardable(model, 2)


def test_cli_refuses_unshardable_model_cleanly(capsys):
    from engine.cli import main
    assert main(["--model", str(ensure_fixture("minicpm")), "--tensor-parallel",
                 "--max-tokens", "2"]) == 2
    assert "tensor parallelism supports model types" in capsys.readouterr().err
