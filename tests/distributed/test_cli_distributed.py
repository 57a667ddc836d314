"""The command lines under `mlx.launch -n 2 --backend ring`: `engine-generate
--tensor-parallel` prints on rank 0 only, the text of the sharded model; `engine-train`
trains data-parallel, prints on rank 0 only, resumes exactly, and refuses a batch
size that does not split over the ranks."""

import mlx.core as mx

from parity.fixtures.models import ensure_fixture
from parity.launch import launch
from tests.train.helpers import not_equal, write_upper_data


def test_generate_and_train_clis_under_launch(tmp_path):
    tp_model = ensure_fixture("llama", "float32", variant="tp2")
    model = ensure_fixture("qwen3")
    data = write_upper_data(tmp_path / "data", n_train=16, n_valid=8)
    r = launch("tests/distributed/cli_worker.py", [tp_model, model, data], tmp_path, n=2,
               timeout=120)
    assert r.returncode == 0, r.output[-4000:]
    r0, r1 = r.ranks
    assert (r0["size"], r1["size"]) == (2, 2)

    g0, g1 = r0["generate"], r1["generate"]
    assert g0["rc"] == g1["rc"] == 0
    assert g0["expected"] == g1["expected"] and g0["expected"]
    assert g0["stdout"].startswith("=" * 10 + "\n" + g0["expected"] + "\n" + "=" * 10)
    assert g1["stdout"] == ""

    for name in ("straight", "first_half", "resumed"):
        assert r0["train"][name]["rc"] == r1["train"][name]["rc"] == 0, name
        assert "Loaded 16 train / 8 valid" in r0["train"][name]["stdout"]
        assert r1["train"][name]["stdout"] == "", name
    # the second half really continued from the saved state (not a fresh 4-step run)
    assert "Resuming from iteration 2" in r0["train"]["resumed"]["stdout"]
    assert "Iter 1:" not in r0["train"]["resumed"]["stdout"]
    straight = mx.load(str(tmp_path / "straight" / "adapters.safetensors"))
    resumed = mx.load(str(tmp_path / "resumed" / "adapters.safetensors"))
    assert not not_equal(straight, resumed)
    assert r0["bad_batch_rc"] == r1["bad_batch_rc"] == 2
