"""L1: `engine.generate` / `stream_generate` vs `mlx_lm.generate` / `stream_generate`.

Greedy tokens and per-step logprobs for every family; seeded sampling with the
same settings gives the same tokens; a warm prompt-cache call equals mlx-lm fed
the same cached prefix and suffix.
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as ref_generate_step
from mlx_lm.generate import stream_generate as ref_stream_generate
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors as ref_processors
from mlx_lm.sample_utils import make_sampler as ref_sampler

import engine
from engine.kv.prompt_cache import PromptCache
from parity.checks import SLIDING
from parity.fixtures.models import FAMILIES, MOE, ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle

pytestmark = pytest.mark.parity

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th number.\"\"\"\n"


def _pair(family, dtype="float32"):
    path = str(ensure_fixture(family, dtype))
    ours = engine.load(path)
    ref = oracle.load(path)
    return ours, ref


def _ref_run(model, tok, prompt, max_tokens, **kw):
    out = list(ref_stream_generate(model, tok, prompt, max_tokens=max_tokens, **kw))
    return out


# float32 and bfloat16 weights; MoE families run bf16 activations over 4-bit experts
# instead (mlx's CPU gather_mm has no bf16 kernel; see test_moe.py).
GREEDY = [(f, d) for f in FAMILIES for d in ("float32", "q4" if f in MOE else "bfloat16")]


@pytest.mark.parametrize("family,dtype", GREEDY, ids=[f"{d}-{f}" for f, d in GREEDY])
def test_greedy_tokens_and_logprobs(family, dtype):
    (model, tok), (rmodel, rtok) = _pair(family, dtype)
    ids = tok.encode(PROMPT)
    assert ids == rtok.encode(PROMPT)
    ref = _ref_run(rmodel, rtok, PROMPT, 24)
    ours = list(engine.stream_generate(model, tok, PROMPT, max_tokens=24, temperature=0.0,
                                       logprobs=True))
    ref_tokens = [r.token for r in ref if r.finish_reason is None or r.finish_reason == "length"]
    got_tokens = [t for s in ours for t in s.token_ids]
    # mlx-lm's last response repeats the last token; its text stream ends at EOS or max_tokens.
    assert got_tokens == [r.token for r in ref][:len(got_tokens)]
    assert "".join(s.text for s in ours) == "".join(r.text for r in ref)
    assert ours[-1].finish_reason == ref[-1].finish_reason
    # per-step logprobs: compare our full vectors against mlx-lm's generate_step
    steps = list(ref_generate_step(mx.array(ids), rmodel, max_tokens=len(got_tokens)))
    from engine.step.stepper import generate_step
    mine = list(generate_step(mx.array(ids), model, max_tokens=len(got_tokens)))
    assert [t for t, _ in mine] == [int(t) for t, _ in steps]
    for (_, a), (_, b) in zip(mine, steps):
        assert mx.array_equal(a, b).item()
    lp = [e["logprob"] for s in ours for e in s.logprobs]
    assert lp == [float(b[int(t)].item()) for t, b in steps][:len(lp)]
    del ref_tokens


SAMPLING = [
    dict(temperature=0.8),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.2, min_p=0.05),
    dict(temperature=0.9, top_p=0.8, top_k=50, repetition_penalty=1.3),
    dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3,
         logit_bias={17: 3.0, 40: -2.0}),
]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma4_text"])
@pytest.mark.parametrize("opts", SAMPLING, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_seeded_sampling_matches(family, opts):
    (model, tok), (rmodel, rtok) = _pair(family)
    # explicit values for every sampler field: generation_config defaults must not leak in
    kw = {"top_p": 0.0, "top_k": 0, "min_p": 0.0, **opts}
    temp = kw.pop("temperature")
    sampler = ref_sampler(temp=temp, top_p=kw.get("top_p", 0.0), min_p=kw.get("min_p", 0.0),
                          top_k=kw.get("top_k", 0))
    procs = ref_processors(logit_bias=kw.get("logit_bias"),
                           repetition_penalty=kw.get("repetition_penalty"),
                           presence_penalty=kw.get("presence_penalty"),
                           frequency_penalty=kw.get("frequency_penalty"))
    for seed in (0, 7):
        mx.random.seed(seed)
        ref = [r.token for r in _ref_run(rmodel, rtok, PROMPT, 20, sampler=sampler,
                                         logits_processors=procs)]
        ours = engine.generate(model, tok, PROMPT, max_tokens=20, temperature=temp, seed=seed, **kw)
        assert ours.token_ids == ref[:len(ours.token_ids)]
        assert len(ours.token_ids) >= len(ref) - 1


@pytest.mark.parametrize("scenario", ["extend", "branch"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_cache_warm_equals_mlx_lm_with_same_prefix(family, scenario):
    """Cold call A fills the cache; warm call B reuses it. "extend": B continues A's
    prompt and completion (no trim needed); "branch": B = A's prompt + other text, so
    the cached completion must be trimmed off. mlx-lm gets the same cache built on the
    same schedule, trimmed to the same prefix, and must give the same tokens/logprobs."""
    (model, tok), (rmodel, rtok) = _pair(family)
    a = tok.encode(PROMPT)
    more = tok.encode(" if n < 2:\n        return n\n", add_special_tokens=False)
    pc = PromptCache(1 << 28)
    cold = engine.generate(model, tok, a, max_tokens=6, prompt_cache=pc, temperature=0.0)
    b = a + (cold.token_ids + more if scenario == "extend" else more)
    warm = engine.generate(model, tok, b, max_tokens=12, prompt_cache=pc, logprobs=True,
                           temperature=0.0)
    assert warm.cached_tokens > 0 and pc.hits == 1

    rc = make_prompt_cache(rmodel)
    if scenario == "branch" and family in SLIDING:
        # The ring wrapped while decoding A and cannot be trimmed back; the hit is the
        # snapshot taken at the end of A's prefill (A minus its last token), so mlx-lm
        # gets a cache after the same prefill (one chunk) and continues from there.
        assert warm.cached_tokens == len(a) - 1
        rmodel(mx.array(a[:-1])[None], cache=rc)
        mx.eval([c.state for c in rc])
        common = len(a) - 1
        ref = list(ref_generate_step(mx.array(b[common:]), rmodel, max_tokens=12, prompt_cache=rc))
        ref_tokens = [int(t) for t, _ in ref]
        assert warm.token_ids == ref_tokens[:len(warm.token_ids)]
        assert [e["logprob"] for e in warm.logprobs] == [
            float(lp[t].item()) for t, lp in zip(ref_tokens, (lp for _, lp in ref))][:len(warm.logprobs)]
        return
    fed = list(ref_generate_step(mx.array(a), rmodel, max_tokens=6, prompt_cache=rc))
    assert [int(t) for t, _ in fed][:len(cold.token_ids)] == cold.token_ids
    held = rc[0].offset
    common = 0
    seq = a + [int(t) for t, _ in fed]
    while common < min(held, len(b) - 1) and seq[common] == b[common]:
        common += 1
    assert common == warm.cached_tokens
    if held > common:
        trim_prompt_cache(rc, held - common)
    ref = list(ref_generate_step(mx.array(b[common:]), rmodel, max_tokens=12, prompt_cache=rc))
    ref_tokens = [int(t) for t, _ in ref]
    assert warm.token_ids == ref_tokens[:len(warm.token_ids)]
    assert [e["logprob"] for e in warm.logprobs] == [
        float(lp[t].item()) for t, lp in zip(ref_tokens, (lp for _, lp in ref))][:len(warm.logprobs)]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in SLIDING])
def test_prompt_cache_cut_to_the_cap_equals_mlx_lm(family):
    """A prefix whose KV is larger than the cap is kept cut to its longest whole-block
    prefix that fits (copied into buffers of exactly that length); the warm call from the
    cut equals mlx-lm fed the same cache trimmed to the same prefix."""
    from engine.kv.prompt_cache import BLOCK
    (model, tok), (rmodel, rtok) = _pair(family)
    a = (tok.encode(PROMPT) * 40)[:2 * BLOCK + 50]
    more = tok.encode(" if n < 2:\n        return n\n", add_special_tokens=False)
    probe = PromptCache(1 << 34)
    engine.generate(model, tok, a, max_tokens=6, prompt_cache=probe, temperature=0.0)
    pc = PromptCache(int(probe.bytes * 0.9))
    cold = engine.generate(model, tok, a, max_tokens=6, prompt_cache=pc, temperature=0.0)
    assert len(pc) == 1 and pc.bytes <= pc.max_bytes
    b = a + cold.token_ids + more
    warm = engine.generate(model, tok, b, max_tokens=12, prompt_cache=pc, logprobs=True,
                           temperature=0.0)
    assert warm.cached_tokens == 2 * BLOCK and pc.hits == 1

    rc = make_prompt_cache(rmodel)
    fed = list(ref_generate_step(mx.array(a), rmodel, max_tokens=6, prompt_cache=rc))
    assert [int(t) for t, _ in fed][:len(cold.token_ids)] == cold.token_ids
    trim_prompt_cache(rc, rc[0].offset - 2 * BLOCK)
    ref = list(ref_generate_step(mx.array(b[2 * BLOCK:]), rmodel, max_tokens=12,
                                 prompt_cache=rc))
    ref_tokens = [int(t) for t, _ in ref]
    assert warm.token_ids == ref_tokens[:len(warm.token_ids)]
    assert [e["logprob"] for e in warm.logprobs] == [
        float(lp[t].item()) for t, lp in zip(ref_tokens, (lp for _, lp in ref))
    ][:len(warm.logprobs)]
