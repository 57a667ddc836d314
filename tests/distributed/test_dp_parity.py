"""L1 under `mlx.launch -n 2 --backend ring`: data-parallel LoRA training gives the
adapters mlx-lm's trainer gives under the same launch and data, bit for bit
(compiled full backward and the segmented backward; float and QLoRA; the slow test
adds minicpm and gemma4_text, which data parallelism needs nothing special for)."""

import mlx.core as mx
import pytest

from parity.fixtures.models import ensure_fixture
from parity.launch import launch
from tests.train.helpers import not_equal, write_upper_data
from train.distributed import data_parallel

pytestmark = pytest.mark.parity


def run(tmp_path, specs, timeout):
    data = write_upper_data(tmp_path / "data", n_train=16, n_valid=8)
    for spec in specs:
        ensure_fixture(*spec.split(":")[:2])
    r = launch("tests/distributed/dp_worker.py", [data, *specs], tmp_path, n=2, timeout=timeout)
    assert r.returncode == 0, r.output[-4000:]
    assert [x["size"] for x in r.ranks] == [2, 2]
    for rank in r.ranks:
        for res in rank["results"]:
            assert res["names_equal"] and res["n_tensors"] > 0, res
            assert res["unequal"] == [], (rank["rank"], res)
            assert len(res["val_losses"]) == 3  # iterations 1, 3 and 4
    # every rank ends with the same adapter and the same (all-reduced) reports;
    # only rank 0 logs
    strip = [[{k: v for k, v in x.items() if k != "log_lines"} for x in rk["results"]]
             for rk in r.ranks]
    assert strip[0] == strip[1]
    assert all(x["log_lines"] > 0 for x in r.ranks[0]["results"])
    assert all(x["log_lines"] == 0 for x in r.ranks[1]["results"])
    return r


def test_dp_adam_steps_equal_mlx_lm_trainer(tmp_path):
    run(tmp_path, ["llama:float32", "llama:float32:segmented"], timeout=120)
    # rank 0 wrote the files; they hold the weights compared above
    ours = mx.load(str(tmp_path / "llama-float32" / "ours" / "adapters.safetensors"))
    ref = mx.load(str(tmp_path / "llama-float32-ref" / "adapters.safetensors"))
    assert not not_equal(ref, ours)


@pytest.mark.slow
def test_dp_qlora_and_other_families_equal_mlx_lm_trainer(tmp_path):
    run(tmp_path, ["qwen3:q4", "minicpm:float32", "gemma4_text:float32",
                   "gemma4_text:float32:segmented"], timeout=300)


def test_single_rank_is_identity():
    dp = data_parallel()
    assert (dp.size, dp.rank, dp.is_main) == (1, 0, True)
    g = {"a": mx.array([1.0, 2.0])}
    assert dp.average(g) is g and dp.sum(g["a"]) is g["a"]
