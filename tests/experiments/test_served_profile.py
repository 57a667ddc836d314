"""experiments/served_profile.py on the CPU: a lone stream per server variant, timed by the
client and by the server's own clock (they agree within the stream's delivery), with every
token counted (streamed chunks may carry several)."""

import json

from engine.loader import resolve_model_path
from experiments import served_profile


def test_one_variant_timed_both_ways(tmp_path):
    model = str(resolve_model_path("builtin:long"))
    served_profile.main(["--model", model, "--gen", "24", "--trials", "1", "--variants",
                         "--batch 1", "--out", str(tmp_path)])
    [row] = json.loads((tmp_path / "served_profile.json").read_text())["results"]
    assert row["variant"] == "--batch 1"
    [trial] = row["trials"]
    assert trial["tokens"] == 24                     # (EOS banned: every token decoded)
    assert trial["engine_tps"] > 0 and trial["client_tps"] > 0 and trial["ttft_ms"] > 0
    # the client sees the same tokens over a span at least as long as the engine's, give or
    # take one delivery: its rate is not above the engine's by more than a small margin
    assert trial["client_tps"] < 1.5 * trial["engine_tps"]
