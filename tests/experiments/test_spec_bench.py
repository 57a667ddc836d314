"""experiments/spec_bench.py's workload: the language its models learn has no special token of
the presets' tokenizer (an EOS learned would end requests early, and banning it with a logit
bias is a logits processor, which turns speculation off), and each prompt's continuation is
a copy of the prompt (the copy-heavy workload prompt lookup is for)."""

from experiments import spec_bench
from experiments.presets import build_preset


def test_the_language_avoids_special_tokens(tmp_path):
    import engine
    _, tok = engine.load(str(build_preset("speed", tmp_path / "m")))
    specials = set(tok.eos_token_ids) | {tok.bos_token_id}
    lang = spec_bench.language()
    seen = {t for _ in range(50) for t in lang.sequence(200)}
    assert seen and max(seen) < 1000 and not seen & specials
    assert min(specials) >= 1000                       # (what the bound relies on)


def test_prompts_are_a_walk_then_the_start_of_its_copy():
    ps = spec_bench.prompts(3, 32, seed=0)
    assert len(ps) == 3 and all(len(p) == 32 + 16 + 8 for p in ps)
    for p in ps:
        assert p[-8:] == p[:8]
    assert spec_bench.prompts(3, 32, seed=0) == ps and spec_bench.prompts(3, 32, seed=1) != ps
