"""L1 with merged projections (`--merged-proj`) through the Engine, in both lanes.

With `levers.merged_proj` the Engine merges q/k/v and gate/up at construction, so
the solo lane (prefill and decode) and every batch row run the merged matmuls.
`mx.array_equal` only:

- `Engine(max_batch=1)`: tokens and every step's logprob vector == mlx-lm's
  `generate_step`;
- `Engine(max_batch=4)`: rows joining at different steps and leaving at different
  lengths == mlx-lm 0.32.2's `BatchGenerator` driven with the same schedule;
- a negative control: one merged weight nudged, and the solo lane no longer equals
  mlx-lm (so the equalities above can fail).

Every family whose attention has separate q/k/v projections, float32 / bfloat16 / 4-bit;
a representative subset runs by default, the full grid under `-m slow`.
"""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as ref_generate_step

import engine
from engine import Engine
from engine.fast.merge import Part, merged_of
from engine.levers import parse_spec
from parity.batch import Insert, compare, run_engine, run_mlx_lm
from parity.fixtures.models import cpu_dtypes, ensure_fixture
from parity.oracles import mlx_lm_oracle as oracle

pytestmark = pytest.mark.parity

FAMILIES = ["llama", "qwen3", "qwen2", "minicpm", "gemma3_text", "gemma4_text"]
DTYPES = ["float32", "bfloat16", "q4"]
DEFAULT = {("llama", "bfloat16"), ("qwen3", "q4"), ("gemma4_text", "float32")}
MERGED = parse_spec("l1+merged_proj")


def _grid():
    out = []
    for f in FAMILIES:
        for d in DTYPES:
            if d not in cpu_dtypes(f):
                continue
            marks = () if (f, d) in DEFAULT else (pytest.mark.slow,)
            out.append(pytest.param(f, d, marks=marks, id=f"{f}-{d}"))
    return out


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(4, 900) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _merged_engine(family, dtype, max_batch):
    path = str(ensure_fixture(family, dtype))
    model, tok = engine.load(path)
    eng = Engine(model, tok, max_batch=max_batch, keep_logprob_arrays=True, levers=MERGED)
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, Part), "the Engine did not merge the projections"
    return eng, oracle.load_model(path)


def _solo_matches(eng, ref_model, prompt, n=10) -> bool:
    ((toks, lps, fin),) = [(r.tokens, r.logprobs, r.finish)
                           for r in run_engine(eng, [Insert(0, prompt, n)])]
    ref = list(ref_generate_step(mx.array(prompt), ref_model, max_tokens=n))
    assert not {int(t) for t, _ in ref} & eng.eos, "fixture produced EOS: pick another prompt"
    return (toks == [int(t) for t, _ in ref] and fin == "length" and len(lps) == len(ref)
            and all(mx.array_equal(a, b).item() for a, (_, b) in zip(lps, ref)))


@pytest.mark.parametrize("family, dtype", _grid())
def test_merged_solo_lane_equals_generate_step(family, dtype):
    eng, ref_model = _merged_engine(family, dtype, max_batch=1)
    for prompt in _prompts(2, seed=3):
        assert _solo_matches(eng, ref_model, prompt)
    assert eng.stats()["solo_reasons"] == {"max_batch=1": 2}


@pytest.mark.parametrize("family, dtype", _grid())
def test_merged_batch_lane_equals_batch_generator(family, dtype):
    eng, ref_model = _merged_engine(family, dtype, max_batch=4)
    p = _prompts(5, seed=5)
    # (the last row joins when two rows are left: with the batch full the Engine would
    # hold it back a step, which BatchGenerator does not)
    schedule = [Insert(0, p[0], 9), Insert(0, p[1], 14), Insert(2, p[2], 6),
                Insert(4, p[3], 11), Insert(12, p[4], 5)]
    ref = run_mlx_lm(ref_model, schedule, completion_batch_size=4, prefill_batch_size=4)
    for r in ref:
        assert not set(r.tokens) & eng.eos, "fixture produced EOS: pick other prompts"
    problems = compare(run_engine(eng, schedule), ref)
    assert not problems, problems[:3]
    st = eng.stats()
    assert st["lanes"] == {"batch": 5, "solo": 0} and st["peak_rows"] >= 3


def test_negative_control_a_nudged_merged_weight_differs():
    """The equalities above can fail: one merged q/k/v weight scaled by 1.01 in one
    layer, and the solo lane no longer equals mlx-lm."""
    eng, ref_model = _merged_engine("llama", "bfloat16", max_batch=1)
    prompt = _prompts(1, seed=3)[0]
    assert _solo_matches(eng, ref_model, prompt)
    lin = merged_of(eng.model.layers[0].self_attn, ("q_proj", "k_proj", "v_proj")).linear
    lin.weight = lin.weight * 1.01
    assert not _solo_matches(eng, ref_model, prompt)


def test_engine_generate_merged_proj_flag(monkeypatch, capsys):
    """`engine-generate --merged-proj` merges the projections (through the Engine) and
    prints the same text as without the flag."""
    import engine.cli as engine_cli
    import engine.fast.apply as apply

    merged = []
    real = apply.merge_projections
    monkeypatch.setattr(apply, "merge_projections", lambda m: merged.append(real(m)) or merged[-1])
    monkeypatch.delenv("MLXP_MERGED_PROJ", raising=False)
    monkeypatch.delenv("MLXP_TIER", raising=False)
    path = str(ensure_fixture("qwen3", "bfloat16"))
    argv = ["--model", path, "--prompt", "def f(x):", "-m", "10", "--temp", "0"]
    texts = []
    for extra in ([], ["--merged-proj"]):
        assert engine_cli.main(argv + extra) == 0
        texts.append(capsys.readouterr().out.split("=" * 10)[1])   # (mlx-lm's layout)
    assert texts[0] == texts[1] and texts[0].strip()
    assert len(merged) == 1 and merged[0] > 0   # only the --merged-proj run merged


def test_engine_serve_merged_proj_flag_keeps_batching(monkeypatch):
    """`engine-serve --merged-proj`: the lever reaches the Engine (which merges at start)
    and, being L1, does not turn batching off as the fast levers' default does."""
    from server.cli import config_from_args, parser

    monkeypatch.delenv("MLXP_MERGED_PROJ", raising=False)
    monkeypatch.delenv("MLXP_TIER", raising=False)
    cfg = config_from_args(parser().parse_args(["--merged-proj"]))
    assert cfg.levers.merged_proj and not cfg.levers.fast_decode and cfg.batch == 32
