"""engine.step.warmup: the fast runner's shapes built before requests arrive, and
engine-serve running it before it says ready (--warm-up)."""

import random

from engine import Engine, SamplingParams
from engine.levers import parse_spec
from engine.step.warmup import buckets_for, warm_up
from parity.fixtures.models import ensure_fixture

import engine

FIXTURE = ensure_fixture("llama", "bfloat16")


def _burst(eng, n, rng, most=9, stagger=False, **kw):
    """n requests of random prompts and lengths (max_tokens below `most`), all at once or, with
    `stagger`, one step apart (as served clients arrive); SamplingParams `kw` added."""
    for _ in range(n):
        eng.submit([rng.randrange(4, 900) for _ in range(rng.randrange(3, 40))],
                   SamplingParams(max_tokens=rng.randrange(2, most), temperature=0.0, **kw))
        if stagger:
            eng.step()
    while eng.has_unfinished():
        eng.step()


def _traffic(eng, burst, seed):
    """The tests' traffic: bursts of 1, 3, 8, 5, 2 and 7 requests (`burst(eng, n, rng)`)."""
    rng = random.Random(seed)
    for n in (1, 3, 8, 5, 2, 7):
        burst(eng, n, rng)


def test_after_the_warm_up_no_traffic_makes_a_trace():
    model, tok = engine.load(str(FIXTURE))
    eng = Engine(model, tok, max_batch=8, levers=parse_spec("l3"), prompt_cache=None)
    assert buckets_for(eng) == (1, 2, 4, 8)
    w = warm_up(eng)
    assert w.buckets == (1, 2, 4, 8) and w.traces >= 4 and w.seconds > 0
    assert eng.lanes == {"batch": 0, "solo": 0} and not eng.has_unfinished()
    before = eng.fast_step.stats.traces
    _traffic(eng, _burst, 0)
    assert eng.fast_step.stats.traces == before


def test_without_the_warm_up_the_first_bursts_trace():
    """The control: the same traffic on a cold engine makes the traces the warm-up made."""
    model, tok = engine.load(str(FIXTURE))
    eng = Engine(model, tok, max_batch=8, levers=parse_spec("l3"))
    _traffic(eng, _burst, 0)
    assert eng.fast_step.stats.traces >= 3


def test_on_the_l1_runners_rows_join_and_leave_and_the_counters_stay():
    """Without a fast runner or draft rows (`l1=True`: the default is CUDA only): one row, then
    max_batch rows joining one step apart (the batch's prefill, joins and leaves built); the
    engine's counters as they were; on the CPU by default nothing."""
    from engine.step.warmup import l1_rows_for
    model, tok = engine.load(str(FIXTURE))
    eng = Engine(model, tok, max_batch=4)
    seen = []
    real = eng.step

    def step():
        out = real()
        seen.append(eng.peak_rows)
        return out
    eng.step = step
    w = warm_up(eng, l1=True)
    assert buckets_for(eng) == () and w.buckets == () and w.l1_rows == (1, 4)
    assert max(seen) == 4                       # (four rows decoded together)
    assert eng.peak_rows == 0 and eng.steps == 0 and eng.lanes == {"batch": 0, "solo": 0}
    assert l1_rows_for(eng, l1=False) == () and warm_up(eng, l1=False).l1_rows == ()
    assert l1_rows_for(eng) == () and warm_up(eng).l1_rows == ()       # (the CPU: off by default)
    assert l1_rows_for(Engine(model, tok, max_batch=64), l1=True) == (1, 8)     # (capped)
    solo = Engine(model, tok, max_batch=1)
    assert warm_up(solo, l1=True).l1_rows == (1,) and not solo.has_unfinished()


def test_the_warm_up_keeps_the_prompt_cache_empty():
    from engine.kv.prompt_cache import PromptCache
    model, tok = engine.load(str(FIXTURE))
    pc = PromptCache(10**8)
    eng = Engine(model, tok, max_batch=4, levers=parse_spec("l3"), prompt_cache=pc)
    warm_up(eng)
    assert eng.prompt_cache is pc and len(pc) == 0


def test_engine_serve_warms_up_before_ready():
    from server.cli import config_from_args, parser
    from server.state import build_state
    for flag, warmed in (("true", True), ("false", False)):
        args = parser().parse_args(["--model", str(FIXTURE), "--tier", "l3", "--batch", "4",
                                    "--warm-up", flag])
        st = build_state(config_from_args(args))
        w = st.stats()["warm_up"]
        assert (w is not None) == warmed
        if warmed:
            assert w["buckets"] == [1, 2, 4] and w["traces"] >= 3 and w["lookup_buckets"] == []
            assert st.stats()["batch"]["lanes"] == {"batch": 0, "serial": 0}
    # --prompt-lookup N on the fast runner: lookup rows and their verify shapes warmed too
    args = parser().parse_args(["--model", str(FIXTURE), "--tier", "l3", "--batch", "4",
                                "--prompt-lookup", "2"])
    st = build_state(config_from_args(args))
    assert st.stats()["warm_up"]["lookup_buckets"] == [1, 2, 4]
    assert st.engine.fast_step.stats.verify_steps > 0


def test_the_long_warm_up_prefills_one_long_prompt_and_keeps_no_trace_of_it(tmp_path):
    """`long_prompt=N` (where the L1 warm-ups run: `l1=True` here, CUDA by default): one
    throw-away prompt of N tokens prefilled, a token decoded after it (the forward saw N
    positions); the prompt caches, RAM and disk, hold none of it; the counters as they were;
    0, 1 or the CPU default: none."""
    from engine.kv.disk_cache import DiskCache
    from engine.kv.prompt_cache import PromptCache
    model, tok = engine.load(str(FIXTURE))
    fed = []

    class Spy:                          # (counts the positions the model is given)
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, inputs, *a, **kw):
            fed.append(inputs.size)
            return model(inputs, *a, **kw)
    pc, disk = PromptCache(10**8), DiskCache(tmp_path, 10**9, model="m", background=False)
    eng = Engine(Spy(), tok, max_batch=4, prompt_cache=pc, disk_cache=disk)
    assert warm_up(eng, l1=True).long_tokens == 0
    plain, fed[:] = sum(fed), []
    w = warm_up(eng, l1=True, long_prompt=300)
    assert w.long_tokens == 300
    assert sum(fed) - plain >= 301      # (300 prompt positions, one more decoded)
    assert len(pc) == 0 and len(disk) == 0 and list(tmp_path.glob("*.safetensors")) == []
    assert eng.steps == 0 and eng.peak_rows == 0 and not eng.has_unfinished()
    assert warm_up(eng, l1=True, long_prompt=1).long_tokens == 0
    # more than the model's context (the default is the longest prefix on disk, which a
    # --max-context or another model's files may exceed): what fits, never a failed start
    from engine.step.warmup import LONG_MAX
    eng.max_context = 700
    assert warm_up(eng, l1=True, long_prompt=10**6).long_tokens == min(LONG_MAX, 698)
    assert warm_up(eng, long_prompt=300).long_tokens == 0          # (the CPU: off by default)


def test_engine_serve_long_warm_up_is_the_disk_caches_longest_prefix(tmp_path):
    """engine-serve's long warm-up: `--warm-up-tokens N`, else the longest prefix its
    `--prompt-cache-dir` holds (what a restart's first turn restores), and that prefix's files
    read once (none with `--warm-up-tokens 0`); a negative N is a CLI error."""
    import pytest
    from server.cli import config_from_args, parser
    from server.state import long_warm_up

    class Disk:
        def longest_chain(self):
            return 4321, ["a", "b"]

    class Eng:
        disk_cache = None

    def cfg(*extra):
        return config_from_args(parser().parse_args(["--model", str(FIXTURE), *extra]))
    eng = Eng()
    assert long_warm_up(cfg(), eng) == (0, [])
    eng.disk_cache = Disk()
    assert long_warm_up(cfg(), eng) == (4321, ["a", "b"])
    assert long_warm_up(cfg("--warm-up-tokens", "0"), eng) == (0, [])
    assert long_warm_up(cfg("--warm-up-tokens", "99"), eng) == (99, ["a", "b"])
    with pytest.raises(SystemExit, match="--warm-up-tokens must be >= 0"):
        cfg("--warm-up-tokens", "-1")


def test_engine_serve_renders_the_chat_template_before_ready():
    """With the warm-up (`--warm-up true`, the default) engine-serve renders its chat template
    once before it says ready, so the first request does not pay its compile; without it, no
    template is compiled at the start."""
    from engine.text.chat_template import _compile_template
    from server.cli import config_from_args, parser
    from server.state import build_state
    for flag, compiled in (("false", 0), ("true", 1)):
        _compile_template.cache_clear()
        build_state(config_from_args(parser().parse_args(["--warm-up", flag])))
        assert _compile_template.cache_info().currsize == compiled, flag


def _spec_engine():
    from engine.levers import resolve
    m, tok = engine.load(str(ensure_fixture("qwen3", "float32")))
    d, _ = engine.load(str(ensure_fixture("qwen3", "bfloat16", variant="long")))
    return Engine(m, tok, max_batch=8, prompt_cache=None, draft_model=d, draft_levers=resolve("l3"))


def _spec_burst(eng, n, rng):
    """n speculating requests arriving one step apart."""
    _burst(eng, n, rng, most=12, stagger=True, num_draft_tokens=4)


def test_the_warm_up_builds_the_speculating_rows_shapes():
    """With a draft model on the fast runner (no fast runner for the model itself), the
    warm-up decodes speculating rows at each of the draft's rows buckets; staggered
    speculating traffic afterwards makes no trace of the draft's step."""
    eng = _spec_engine()
    assert buckets_for(eng) == () and eng.draft_step is not None
    w = warm_up(eng)
    assert w.draft_buckets == (1, 2, 4, 8) and w.traces >= 4
    # the rows did speculate, on the draft's fast runner; the engine's counters left as they were
    assert eng.draft_step.stats.steps > 0 and eng.stats()["speculation"]["drafted"] == 0
    assert eng.lanes == {"batch": 0, "solo": 0} and not eng.has_unfinished()
    before = eng.draft_step.stats.traces
    _traffic(eng, _spec_burst, 1)
    assert eng.draft_step.stats.traces == before


def test_without_the_warm_up_speculating_bursts_trace():
    """The control: the same traffic on a cold engine traces the draft's step."""
    eng = _spec_engine()
    _traffic(eng, _spec_burst, 1)
    assert eng.draft_step.stats.traces >= 3


def _lookup_burst(eng, n, rng):
    """n prompt-lookup requests arriving one step apart, their prompts repetitive (drafts found)."""
    for _ in range(n):
        period = rng.randrange(2, 6)
        base = [rng.randrange(4, 900) for _ in range(period)]
        eng.submit((base * 12)[:rng.randrange(8, 40)],
                   SamplingParams(max_tokens=rng.randrange(4, 14), temperature=0.0,
                                  prompt_lookup=2, num_draft_tokens=4))
        eng.step()
    while eng.has_unfinished():
        eng.step()


def _fast_spec_engine(draft: bool):
    from engine.levers import resolve
    m, tok = engine.load(str(ensure_fixture("qwen3", "float32")))
    d = engine.load(str(ensure_fixture("qwen3", "bfloat16", variant="long")))[0] if draft else None
    return Engine(m, tok, max_batch=8, prompt_cache=None, levers=resolve("l3"), draft_model=d,
                  draft_levers=resolve("l3") if draft else None)


def _fast_traces(eng):
    return sum(s.stats.traces for s in (eng.fast_step, eng.draft_step) if s is not None)


def test_on_the_fast_runner_the_warm_up_builds_the_verify_shapes():
    """The model on the fast runner, rows speculating (a draft model; prompt lookup with
    `lookup`): the warm-up's speculating rows run verify steps at each rows bucket, and
    staggered speculating traffic afterwards traces neither the model's step nor the draft's;
    the control, the same traffic on cold engines, traces both."""
    from engine.step.warmup import lookup_buckets_for
    rng_seed = 3
    for draft in (True, False):
        eng = _fast_spec_engine(draft)
        assert lookup_buckets_for(eng, 0) == () and eng.lookup_rows
        w = warm_up(eng, lookup=0 if draft else 2)
        assert (w.draft_buckets if draft else w.lookup_buckets) == (1, 2, 4, 8)
        assert eng.fast_step.stats.verify_steps > 0 and eng.stats()["speculation"]["drafted"] == 0
        before = _fast_traces(eng)
        _traffic(eng, _spec_burst if draft else _lookup_burst, rng_seed)
        assert eng.stats()["speculation"]["drafted"] > 0
        assert _fast_traces(eng) == before
        cold = _fast_spec_engine(draft)
        _traffic(cold, _spec_burst if draft else _lookup_burst, rng_seed)
        assert _fast_traces(cold) >= 4


def test_verify_shapes_name_exact_call_rows_while_one_kernel_call_takes_them(monkeypatch):
    """With a one kernel of up to 8 rows a call (mega_rows 8) a verify of 3, 5, 6 or 7 call rows
    runs that many rows (0.6.1), so the warm-up builds those shapes; past 8, buckets; without
    the one kernel, buckets only (the control)."""
    from engine.fast.apply import fast_step_for
    from engine.step.warmup import verify_shapes
    m = engine.load(str(ensure_fixture("qwen3", "float32")))[0]
    step = fast_step_for(m, parse_spec("l3"))
    monkeypatch.setattr(step, "mega_rows", 8)
    calls = {c for c, _ in verify_shapes(step, 4, 4)}
    assert {1, 2, 3, 4, 5, 6, 7, 8} <= calls and calls - set(range(1, 9)) == {16, 32}
    monkeypatch.setattr(step, "mega_rows", 0)
    assert {c for c, _ in verify_shapes(step, 4, 4)} == {1, 2, 4, 8, 16, 32}


def test_with_exact_verify_rows_the_warm_up_still_covers_speculating_traffic(monkeypatch):
    """A one kernel of up to 8 rows a call (mega_rows 8; the CPU's stand-ins take any rows):
    verifies run their exact call rows (0.6.1), and after the warm-up staggered prompt-lookup
    traffic traces no new shape; the same traffic on a cold engine does."""
    def engine_of_8_rows_a_call():
        eng = _fast_spec_engine(False)
        monkeypatch.setattr(eng.fast_step, "mega_rows", 8)
        assert eng.fast_step.verify_rows_for(5) == 5
        return eng
    eng = engine_of_8_rows_a_call()
    warm_up(eng, lookup=2)
    before = _fast_traces(eng)
    _traffic(eng, _lookup_burst, 5)
    assert eng.stats()["speculation"]["drafted"] > 0
    assert _fast_traces(eng) == before
    shapes = {k[0] for k in eng.fast_step.trace_keys if k[4] is not None}
    assert shapes & {3, 5, 6, 7}                  # (exact call rows ran: not only buckets)
    cold = engine_of_8_rows_a_call()
    _traffic(cold, _lookup_burst, 5)
    assert _fast_traces(cold) > 0


def test_with_stored_files_the_warm_up_runs_the_next_turns_attention(monkeypatch, tmp_path):
    """With files to rehearse (a restart with a stored prefix) the warm-up also runs the
    attention calls of a next turn over the long prompt's length (`bucketed_sdpa.warm_turns`
    with the model's attention shapes); without files, or with no long prompt, it does not."""
    import engine.step.warmup as W
    model, tok = engine.load(str(FIXTURE))
    seen = []
    monkeypatch.setattr(W, "warm_turns", lambda shapes, n: seen.append((shapes, n)) or 7)
    eng = Engine(model, tok, max_batch=2)
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"not a cache file")            # (a bad file: read fails, nothing rehearsed)
    w = warm_up(eng, l1=True, long_prompt=120, rehearse=[f])
    assert seen == [(W.attention_shapes(model), 120)] and w.turn_shapes == 7
    seen.clear()
    assert warm_up(eng, l1=True, long_prompt=120).turn_shapes == 0 and seen == []
    assert warm_up(eng, l1=True, rehearse=[f]).turn_shapes == 0 and seen == []
