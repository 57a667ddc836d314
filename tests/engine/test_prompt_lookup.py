"""Prompt-lookup speculative decoding (engine.step.lookup): drafts from the request's own
prompt and output, verified in one forward, greedy.

On the CPU a forward over several tokens gives each position the logits single steps give
(checked first here), so a request with speculation gives the same tokens and logprob vectors
as without, bit for bit, in fewer forwards; a negative control (the rejected drafts left in
the caches) makes the same comparison fail."""

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.step.lookup import NgramIndex
from parity.fixtures.models import ensure_fixture

REPEATS = [5, 6, 7, 8, 9, 10, 11, 12] * 6      # a prompt that repeats itself


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return engine.load(str(ensure_fixture(request.param, "bfloat16")))


def _run(model, tok, prompt, max_batch=1, **kw):
    eng = Engine(model, tok, max_batch=max_batch, keep_logprob_arrays=True)
    rid = eng.submit(prompt, SamplingParams(max_tokens=40, temperature=0.0, **kw))
    toks, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.token_ids
                lps += o.logprob_arrays
    return toks, lps, eng


def test_the_index_proposes_what_followed_the_latest_match():
    idx = NgramIndex([1, 2, 3, 9, 1, 2, 3, 7, 1, 2], 2)
    assert idx.propose(3) == [3, 7, 1]          # after the latest earlier "1 2"
    idx.append(3)
    assert idx.propose(2) == [7, 1]             # "2 3" last seen before 7
    assert NgramIndex([4, 5], 2).propose(3) == [] and idx.propose(0) == []
    # a continuation that runs into the newest tokens repeats with their period (it stopped
    # at the end of the list before 0.5.4: [6, 1, 2])
    assert NgramIndex([1, 2, 6, 1, 2], 2).propose(9) == [6, 1, 2] * 3
    assert NgramIndex([5, 7, 7, 7, 7], 3).propose(4) == [7, 7, 7, 7]
    assert NgramIndex([1, 2, 3, 1, 2, 3, 1], 1).propose(5) == [2, 3, 1, 2, 3]
    assert NgramIndex([1, 2, 3, 9, 1, 2], 2).propose(2) == [3, 9]     # (k within: unchanged)


def test_several_positions_in_one_forward_equal_single_steps_on_the_cpu(model):
    m, _ = model
    ids = list(range(10, 60))
    a = m.make_cache()
    m(mx.array(ids[:40])[None], cache=a)
    singles = [m(mx.array([[x]]), cache=a)[0, -1] for x in ids[40:45]]
    b = m.make_cache()
    m(mx.array(ids[:40])[None], cache=b)
    multi = m(mx.array(ids[40:45])[None], cache=b)[0]
    assert all(mx.array_equal(singles[i], multi[i]).item() for i in range(5))


@pytest.mark.parametrize("max_batch", [1, 4])
def test_same_tokens_and_logprobs_as_without_in_fewer_forwards(model, max_batch):
    m, tok = model
    ref, ref_lp, _ = _run(m, tok, REPEATS, max_batch)
    got, got_lp, eng = _run(m, tok, REPEATS, max_batch, prompt_lookup=3, num_draft_tokens=5)
    assert got == ref and len(got) == 40
    assert all(mx.array_equal(x, y).item() for x, y in zip(got_lp, ref_lp))
    spec = eng.stats()["speculation"]
    assert spec["accepted"] > 0 and spec["forwards"] < 40
    if max_batch > 1:       # a speculating row of the batch (engine.step.batch_lookup)
        assert eng.stats()["lanes"] == {"batch": 1, "solo": 0}


def test_negative_control_rejected_drafts_left_in_the_caches_differ(model, monkeypatch):
    m, tok = model
    ref, _, _ = _run(m, tok, REPEATS)
    from engine.kv.cache import KVCache
    monkeypatch.setattr(KVCache, "trim", lambda self, n: 0)
    got, _, eng = _run(m, tok, REPEATS, prompt_lookup=3, num_draft_tokens=5)
    assert eng.stats()["speculation"]["drafted"] > eng.stats()["speculation"]["accepted"]
    assert got != ref


def test_a_stop_mid_draft_leaves_a_prompt_cache_that_answers_right(model):
    """The request ends on a stop string inside an accepted run of drafts: the caches it
    leaves in the prompt cache hold exactly its tokens, so a follow-up that hits them answers
    as a cold engine does."""
    m, tok = model
    full, _, _ = _run(m, tok, REPEATS)
    stop = tok.decode(full[10:12])
    eng = Engine.load(str(ensure_fixture(m.model_type, "bfloat16")), max_batch=1,
                      prompt_cache_bytes=10**8)
    eng.submit(REPEATS, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop],
                                       prompt_lookup=3, num_draft_tokens=8))
    first = []
    while eng.has_unfinished():
        first += [t for o in eng.step() for t in o.token_ids]
    follow = REPEATS + first + [5, 6, 7]
    eng.submit(follow, SamplingParams(max_tokens=12, temperature=0.0))
    warm, cached = [], 0
    while eng.has_unfinished():
        for o in eng.step():
            warm += o.token_ids
            cached = max(cached, o.cached_tokens)
    cold, _, _ = _run(m, tok, follow)
    assert cached > len(REPEATS) and warm == cold[:12]


def test_bad_settings_name_the_field():
    for kw in ({"prompt_lookup": -1}, {"prompt_lookup": 2.5}, {"num_draft_tokens": 0},
               {"num_draft_tokens": 65}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    assert not SamplingParams(prompt_lookup=3, temperature=0.7).looks_up()
    assert not SamplingParams(prompt_lookup=3, temperature=0.0, repetition_penalty=1.1).looks_up()
    assert SamplingParams(prompt_lookup=3, temperature=0.0).looks_up()


def test_default_draft_tokens_follow_the_device(monkeypatch):
    """--num-draft-tokens unset: 3 with --draft-model, and with --prompt-lookup 4 on the CPU
    or Metal but 15 on CUDA (a verify's query is padded to 16 positions there anyway)."""
    import argparse

    from engine import argparsing
    from engine.models import bucketed_sdpa
    ap = argparse.ArgumentParser()
    argparsing.add_speculation_flags(ap.add_argument)
    assert argparsing.speculation_settings(ap.parse_args(["--prompt-lookup", "3"])) == (3, 4)
    assert argparsing.speculation_settings(ap.parse_args(["--draft-model", "d"])) == (0, 3)
    monkeypatch.setattr(bucketed_sdpa, "on_cuda", lambda device=None: True)
    assert argparsing.speculation_settings(ap.parse_args(["--prompt-lookup", "3"])) == (3, 15)
    assert argparsing.speculation_settings(ap.parse_args(["--draft-model", "d"])) == (0, 3)
    assert argparsing.speculation_settings(
        ap.parse_args(["--prompt-lookup", "3", "--num-draft-tokens", "6"])) == (3, 6)


def test_served_with_prompt_lookup_answers_the_same_and_counts_drafts():
    """engine-serve --prompt-lookup 3: a greedy completion equals the server without it, and
    /stats counts the drafts; a bad value is a start-up error naming the flag."""
    import httpx

    from tests.server.srv_helpers import start_server, stop_server
    path = str(ensure_fixture("llama", "bfloat16"))
    body = {"prompt": REPEATS, "max_tokens": 30, "temperature": 0}
    outs = []
    for lookup in (0, 3):
        s = start_server(path, prompt_lookup=lookup, prompt_cache_bytes=0)
        try:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200
            outs.append(r.json()["choices"][0]["text"])
            spec = httpx.get(s.url + "/stats").json()["speculation"]
            assert (spec["accepted"] > 0) == bool(lookup)
            assert spec["lookup"]["accepted"] == spec["accepted"] and spec["draft"]["drafted"] == 0
            assert [r["source"] for r in spec["recent"]] == (["lookup"] if lookup else [])
            metrics = httpx.get(s.url + "/metrics").text
            line = next(x for x in metrics.splitlines()
                        if x.startswith('engine_spec_accepted_tokens_total{source="lookup"} '))
            assert float(line.split()[1]) == spec["accepted"]
        finally:
            stop_server(s)
    assert outs[0] == outs[1]
    from server.cli import main
    with pytest.raises(SystemExit, match="prompt-lookup"):
        main(["--model", path, "--prompt-lookup", "99"])


def test_sliding_window_models_refuse_prompt_lookup_unless_deterministic(tmp_path):
    """A sliding-window ring verifying several tokens in one forward does not give the
    logits of single steps (gemma3_text's greedy output changed): the Engine refuses a
    lookup request there (deterministic mode, whose windows stay in order, takes it), and
    engine-generate / engine-serve refuse --prompt-lookup with a one-line error."""
    import subprocess
    import sys

    from engine.step.lookup import lookup_unsupported
    path = ensure_fixture("gemma3_text", "float32")
    gm, gt = engine.load(str(path))
    assert "RotatingKVCache" in lookup_unsupported(gm)
    assert lookup_unsupported(engine.load(str(ensure_fixture("llama", "bfloat16")))[0]) is None
    with pytest.raises(ValueError, match="prompt_lookup: this model's caches"):
        Engine(gm, gt).submit(REPEATS, SamplingParams(max_tokens=4, prompt_lookup=2))
    det = Engine(gm, gt, deterministic=True)
    det.submit(REPEATS, SamplingParams(max_tokens=4, prompt_lookup=2))
    while det.has_unfinished():
        det.step()
    for cli in (["-m", "engine.cli", "--prompt", "hi", "--max-tokens", "2"],
                ["-m", "server.cli", "--port", "0"]):
        r = subprocess.run([sys.executable, *cli, "--model", str(path), "--prompt-lookup", "2"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "--prompt-lookup: this model's caches" in r.stderr and "Traceback" not in r.stderr
