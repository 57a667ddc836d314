"""Draft-model speculative decoding in the Engine, the CLIs and the server (parity with
mlx-lm's speculative loop: tests/parity/test_draft.py).

On the CPU a forward over several tokens gives each position the logits single steps give
(tests/engine/test_prompt_lookup.py checks it), so a greedy request with a draft model gives
the tokens and logprob vectors it gives without one, bit for bit. What a request leaves in the
prompt cache answers a follow-up as a cold engine does. Bad settings are one clear error."""

import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.step.draft import DraftModelError, check_draft, load_draft
from parity.fixtures.models import ensure_fixture

PROMPT = "def fibonacci(n):\n    return n if n < 2 else fib"


@pytest.fixture(scope="module")
def llama():
    model, tok = engine.load(str(ensure_fixture("llama", "bfloat16")))
    draft, _ = engine.load(str(ensure_fixture("llama", "q4")))
    return model, tok, draft


def _run(model, tok, prompt, draft=None, max_batch=1, **kw):
    eng = Engine(model, tok, max_batch=max_batch, keep_logprob_arrays=True, draft_model=draft)
    rid = eng.submit(prompt, SamplingParams(**{"max_tokens": 40, "temperature": 0.0, **kw}))
    toks, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None
            if o.request_id == rid:
                toks += o.token_ids
                lps += o.logprob_arrays
    return toks, lps, eng


@pytest.mark.parametrize("max_batch", [1, 4])
def test_greedy_with_a_draft_model_equals_without(llama, max_batch):
    m, tok, d = llama
    ref, ref_lp, _ = _run(m, tok, PROMPT, max_batch=max_batch)
    got, got_lp, eng = _run(m, tok, PROMPT, d, max_batch=max_batch, num_draft_tokens=4)
    assert got == ref and len(got) >= 10
    assert all(mx.array_equal(a, b).item() for a, b in zip(got_lp, ref_lp))
    spec = eng.stats()["speculation"]
    assert 0 < spec["draft"]["accepted"] < spec["draft"]["drafted"]
    assert spec["accepted"] == spec["draft"]["accepted"] and spec["lookup"]["drafted"] == 0
    assert spec["draft"]["forwards"] < len(got)
    (recent,) = spec["recent"]
    assert recent["source"] == "draft" and recent["accepted"] == spec["draft"]["accepted"]


def test_requests_that_do_not_speculate(llama):
    """use_draft=False: no drafts, and a batching engine batches it. Logits processors
    (penalties): alone (max_batch 1) no drafts; as a batch row they draft since 0.5.3, each
    verify position processed as a single step (tests/engine/test_grammar_speculation.py),
    the same tokens."""
    m, tok, d = llama
    for kw, batch, drafts in (({"use_draft": False}, 4, False),
                              ({"repetition_penalty": 1.2}, 1, False),
                              ({"repetition_penalty": 1.2}, 4, True)):
        ref, _, _ = _run(m, tok, PROMPT, max_batch=batch, **kw)
        got, _, eng = _run(m, tok, PROMPT, d, max_batch=batch, **kw)
        assert got == ref and (eng.stats()["speculation"]["drafted"] > 0) == drafts
        assert eng.stats()["lanes"] == ({"batch": 1, "solo": 0} if batch > 1
                                        else {"batch": 0, "solo": 1})


class _Keeping(Engine):
    """An Engine that notes what each request leaves in the prompt cache."""

    def _keep(self, req, tokens, caches, copy_caches=True):
        self.kept = getattr(self, "kept", []) + [(list(tokens), caches[0].offset)]
        super()._keep(req, tokens, caches, copy_caches)


@pytest.mark.parametrize("where", ["draft", "bonus"])
def test_an_end_mid_round_leaves_a_prompt_cache_that_answers_right(llama, where):
    """The request ends (its length) on a draft with more accepted drafts after it in the same
    verify step ("draft"), or on the target's own token after accepted drafts ("bonus"): its
    caches hold every token handed out but the last, and the last too when it was a draft
    (its key was computed by the verify forward), nothing else; a follow-up that hits them
    (its draft prefilling the whole prompt) answers as a cold engine does."""
    from engine.step.draft import draft_generate_step

    m, tok, d = llama
    ids = tok.encode(PROMPT)
    steps = list(draft_generate_step(mx.array(ids), m, d, max_tokens=40, caches=m.make_cache(),
                                     draft_caches=d.make_cache(), num_draft_tokens=6))
    flags, toks = [f for _, _, f in steps], [t for t, _, _ in steps]

    def text(n):
        return tok.decode(toks[:n])
    if where == "draft":    # a stop string: the text up to a draft followed by another one
        p = next(i for i in range(1, len(flags) - 1) if flags[i] and flags[i + 1]
                 and text(i + 1) != text(i) and "\ufffd" not in text(i + 1))
        end = dict(max_tokens=40, stop=[text(p + 1)])
    else:                   # max_tokens: the target's token after accepted drafts
        p = next(i for i in range(1, len(flags)) if flags[i - 1] and not flags[i])
        end = dict(max_tokens=p + 1)
    eng = _Keeping(m, tok, max_batch=1, draft_model=d, prompt_cache=engine.PromptCache(10**8))
    eng.submit(ids, SamplingParams(temperature=0.0, num_draft_tokens=6, **end))
    first = []
    while eng.has_unfinished():
        first += [t for o in eng.step() for t in o.token_ids]
    assert first == toks[:p + 1]
    (tokens, offset), = eng.kept
    assert offset == len(tokens) == len(ids) + p + (where == "draft")
    follow = ids + first + tok.encode(" x", add_special_tokens=False)
    eng.submit(follow, SamplingParams(max_tokens=12, temperature=0.0, num_draft_tokens=6))
    warm, cached = [], 0
    while eng.has_unfinished():
        for o in eng.step():
            warm += o.token_ids
            cached = max(cached, o.cached_tokens)
    cold, _, _ = _run(m, tok, follow, max_tokens=12)
    assert cached == offset and warm == cold


def test_engine_load_takes_a_draft_model_path():
    path, draft = (str(ensure_fixture("llama", d)) for d in ("bfloat16", "q4"))
    eng = Engine.load(path, draft_model=draft)
    m, tok, _ = eng.model, eng.tokenizer, eng.draft_model
    assert eng.draft_model is not None
    # memory admission counts the draft's weights and its KV (every token, as the model's)
    from engine.step.admission import Admission, weight_bytes
    alone = Admission.for_model(m, eng.admission.budget_bytes)
    assert eng.admission.weights == alone.weights + weight_bytes(eng.draft_model)
    assert eng.admission.kv_bytes(4096) > alone.kv_bytes(4096)
    assert eng.admission.max_context() < alone.max_context()
    ref, _, _ = _run(m, tok, PROMPT, max_tokens=12)
    got = engine.generate(m, tok, PROMPT, max_tokens=12, temperature=0.0,
                          draft_model=eng.draft_model).token_ids
    assert got == ref


def test_bad_draft_models_and_settings_are_clear_errors(llama):
    m, tok, d = llama
    llama_path = str(ensure_fixture("llama", "bfloat16"))
    with pytest.raises(DraftModelError, match="tokenizer vocabulary is not the target's"):
        load_draft(str(ensure_fixture("qwen3", "q4")), m, tok)
    with pytest.raises(DraftModelError, match="cannot load the draft model: .*no such"):
        load_draft("/no/such/draft", m, tok)
    with pytest.raises(DraftModelError, match="tokenizer vocabulary"):
        Engine.load(llama_path, draft_model=str(ensure_fixture("qwen3", "q4")))
    g, gtok = engine.load(str(ensure_fixture("gemma3_text", "bfloat16")))
    with pytest.raises(DraftModelError, match="RotatingKVCache.*full-attention layers only"):
        check_draft(g, gtok, g, gtok)
    for kw in ({"kv_bits": 4}, {"max_kv_size": 64}):
        with pytest.raises(DraftModelError, match="unquantized, unbounded"):
            Engine(m, tok, draft_model=d, **kw)
    eng = Engine(m, tok, draft_model=d)
    with pytest.raises(ValueError, match="^prompt_lookup"):
        eng.submit(PROMPT, SamplingParams(prompt_lookup=2))
    with pytest.raises(ValueError, match="^use_draft"):
        SamplingParams(use_draft="yes")
    with pytest.raises(ValueError, match="^num_draft_tokens"):
        SamplingParams(num_draft_tokens=65)


@pytest.mark.parametrize("argv,says", [
    (["--draft-model", "/no/such/draft"], "--draft-model: cannot load the draft model"),
    (["--draft-model", "QWEN"], "tokenizer vocabulary is not the target's"),
    (["--draft-model", "DRAFT", "--prompt-lookup", "2"], "--draft-model and --prompt-lookup"),
    (["--draft-model", "DRAFT", "--num-draft-tokens", "0"], "--num-draft-tokens must be in"),
    (["--draft-model", "DRAFT", "--num-draft-tokens", "65"], "--num-draft-tokens must be in"),
    (["--draft-model", "DRAFT", "--kv-bits", "4"], "not supported with"),
])
def test_engine_generate_bad_draft_settings(capsys, argv, says):
    from engine.cli import main
    paths = {"DRAFT": str(ensure_fixture("llama", "q4")), "QWEN": str(ensure_fixture("qwen3", "q4"))}
    argv = [paths.get(a, a) for a in argv]
    rc = main(["--model", str(ensure_fixture("llama", "bfloat16")), "-p", "hi", "-m", "4",
               *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and says in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_served_with_a_draft_model_answers_the_same_and_counts_drafts():
    """engine-serve --draft-model: a greedy completion equals the server without it, /stats
    and /metrics count the drafts by source; bad settings stop the start with one line."""
    import httpx

    from engine.step.admission import weight_bytes
    from server.cli import main
    from tests.server.srv_helpers import start_server, stop_server
    path, draft = (str(ensure_fixture("llama", d)) for d in ("bfloat16", "q4"))
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    outs = []
    for dm, tier in ((None, "l1"), (draft, "l1"), (draft, "l3")):
        s = start_server(path, draft_model=dm, num_draft_tokens=3, prompt_cache_bytes=0,
                         draft_tier=tier)
        try:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200
            outs.append(r.json()["choices"][0]["text"])
            spec = httpx.get(s.url + "/stats").json()["speculation"]
            assert (spec["draft"]["accepted"] > 0) == bool(dm) and spec["draft_model"] == dm
            # --draft-tier l3: the batch rows' draft steps on the fast runner
            assert spec["draft_runner"] == (None if dm is None else "fast" if tier == "l3" else "l1")
            # admission counts the draft's weights
            assert (s.state.admission.weights > weight_bytes(s.state.model)) == bool(dm)
            metrics = httpx.get(s.url + "/metrics").text
            line = next(x for x in metrics.splitlines()
                        if x.startswith('engine_spec_accepted_tokens_total{source="draft"} '))
            assert float(line.split()[1]) == spec["draft"]["accepted"]
        finally:
            stop_server(s)
    assert outs[0] == outs[1] == outs[2]
    with pytest.raises(SystemExit, match="--draft-tier and --draft-max-rows need --draft-model"):
        main(["--model", path, "--draft-tier", "l3"])
    with pytest.raises(SystemExit, match="--draft-model and --prompt-lookup"):
        main(["--model", path, "--draft-model", draft, "--prompt-lookup", "2"])
    with pytest.raises(SystemExit, match="--num-draft-tokens must be in"):
        main(["--model", path, "--draft-model", draft, "--num-draft-tokens", "99"])


def test_the_draft_tier_defaults_to_the_fast_runner_on_cuda(monkeypatch):
    """engine-serve --draft-model without --draft-tier: l3 on CUDA (the draft's steps on the
    fast runner), l1 elsewhere; without a draft model it stays l1; an explicit tier wins."""
    from engine.models import bucketed_sdpa
    from server.cli import config_from_args, parser
    path, draft = (str(ensure_fixture("llama", d)) for d in ("bfloat16", "q4"))

    def tier(*argv):
        return config_from_args(parser().parse_args(["--model", path, *argv])).draft_tier
    assert tier("--draft-model", draft) == "l1" and tier() == "l1"
    monkeypatch.setattr(bucketed_sdpa, "on_cuda", lambda device=None: True)
    assert tier("--draft-model", draft) == "l3" and tier() == "l1"
    assert tier("--draft-model", draft, "--draft-tier", "l1") == "l1"
