"""The served benchmark's per-level table: ours / mlx-lm ratios and failed counts."""
from experiments.bench_batching import SERVED, served_rows


def _row(server, clients, agg, ttft, tps, lost=0, dup=0):
    return dict(model="m", server=server, clients=clients, batch=8, trials=3, agg_tps=agg,
                ttft_p50_ms=ttft, ttft_p95_ms=ttft, req_tps_p50=tps, lost=lost, duplicated=dup,
                wall_s=1.0)


def test_served_rows_join_the_servers_per_level():
    rows = [_row("engine-serve", 1, 300.0, 50.0, 300.0), _row("mlx_lm.server", 1, 100.0, 100.0, 120.0),
            _row("engine-serve", 8, 900.0, 80.0, 110.0, lost=1),
            _row("mlx_lm.server", 8, 450.0, 40.0, 60.0, lost=2, dup=1),
            _row("engine-serve", 32, 1.0, 1.0, 1.0)]            # no peer row: left out
    got = served_rows(rows)
    assert [r["clients"] for r in got] == [1, 8]
    assert set(got[0]) == set(SERVED)
    assert got[0]["ratio"] == 3.0 and got[0]["stream_ratio"] == 2.5 and got[0]["ttft_ratio"] == 0.5
    assert got[1]["ours_failed"] == 1 and got[1]["mlx_lm_failed"] == 3
    assert got[1]["ratio"] == 2.0 and got[1]["ttft_ratio"] == 2.0


def test_a_stream_s_tail_after_its_last_text_is_measured():
    """`one` (each request of bench_batching and spec_bench): the time from the last text chunk
    to the stream's end is its own number (`tail`), not folded into the decode rate: a server
    that holds the end back 0.2 s after the last text shows it; one that does not, ~0."""
    import json
    import time

    import httpx

    from experiments.bench_batching import one

    def sse(hold):
        def gen():
            for text in ("a", "b", "c"):
                time.sleep(0.05)
                yield f'data: {json.dumps({"choices": [{"text": text}]})}\n\n'.encode()
            time.sleep(hold)
            yield f'data: {json.dumps({"choices": [{"text": "", "finish_reason": "length"}]})}\n\n'.encode()
            yield f'data: {json.dumps({"choices": [], "usage": {"completion_tokens": 3}})}\n\n'.encode()
            yield b"data: [DONE]\n\n"
        return httpx.MockTransport(lambda request: httpx.Response(200, content=gen()))

    tails = []
    for hold in (0.2, 0.0):
        out = [None]
        with httpx.Client(transport=sse(hold), base_url="http://x") as c:
            one(c, [1, 2], 3, {}, out, 0, 0)
        assert out[0]["tokens"] == 3 and out[0]["finals"] == 1
        tails.append(out[0]["tail"])
    assert tails[0] >= 0.2 and tails[1] < 0.05
