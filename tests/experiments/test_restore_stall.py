"""experiments/restore_stall.py on a CPU fixture: a restarted engine reads a prefix from disk
while another row decodes; read in parts, the other row gets tokens while it is read, read
whole it gets none until the read is done (the check can tell the two apart); both agents'
prefixes come back whole."""

from experiments import restore_stall
from parity.fixtures.models import ensure_fixture


def test_parts_let_the_running_row_decode_while_whole_does_not(tmp_path):
    rows = restore_stall.main(["--model", str(ensure_fixture("qwen3")), "--prefix-tokens", "300",
                               "--rounds", "1", "--other-tokens", "60", "--part-bytes", "1024",
                               "--out", str(tmp_path)])
    by = {r["mode"]: r for r in rows}
    assert by["whole"]["tokens_restored"] == by["parts"]["tokens_restored"] == 300
    assert by["parts"]["other_tokens_while_reading"] >= 3 + by["whole"]["other_tokens_while_reading"]
    assert (tmp_path / "run.json").exists()
