"""experiments/agent_session.py's restart phase on the CPU: every turn after the first is
answered by a server started afresh on the cache directory, which reads the earlier turns'
prefix back (cached tokens, and the read's time in `disk_restore_ms`). On an H100 in 0.6.1 this
phase measured nothing but cold prefills (the server was killed before its file was written)
and said nothing about it: the columns here would have shown it. Each turn also says where the
server's time to its first token went (`/stats` queue.last_generation): the restore inside the
lookup, the prefill after it."""

from experiments import agent_session


def test_restarted_turns_read_the_prefix_back_and_say_how_long_it_took(tmp_path):
    rows = agent_session.main(["--model", "builtin:long", "--prefix-tokens", "600", "--turns", "3",
                               "--phases", "restart", "--no-warm-up", "--out", str(tmp_path)])
    assert [r["turn"] for r in rows] == [1, 2, 3]
    first, *later = rows
    assert first["cached_tokens"] == 0 and first["disk_restore_ms"] == 0.0
    assert first["disk_bytes_written"] > 0
    for before, r in zip(rows, later):
        assert r["cached_tokens"] >= before["prompt_tokens"] - 1, r
        assert r["disk_restore_ms"] > 0, r
        assert r["lookup_ms"] >= r["disk_restore_ms"] and r["prefill_ms"] > 0, r
    assert first["lookup_ms"] < later[0]["lookup_ms"]      # (nothing to restore on turn 1)
    header = (tmp_path / "agent_session.csv").read_text().splitlines()[0].split(",")
    assert header[-7:] == ["disk_restore_ms", "prepare_ms", "queue_ms", "waiting_ms", "lookup_ms",
                           "prefill_ms", "first_text_ms"]
    for r in rows:     # the phases fit in the first text's time, and all of it in the TTFT
        assert r["prepare_ms"] > 0, r
        assert r["waiting_ms"] + r["lookup_ms"] + r["prefill_ms"] <= r["first_text_ms"] + r["queue_ms"] + 0.3, r
        assert r["prepare_ms"] + r["queue_ms"] + r["first_text_ms"] <= r["ttft_ms"] + 0.3, r
