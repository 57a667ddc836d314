"""Speculation with logits processors: a grammar-constrained request (`response_format`,
forced tool calls) or one with penalties and logit bias speculates as a row of the batch,
prompt lookup or draft model, and every verify position is processed as a single step would
be (engine.step.batch_lookup `processed_positions`: a grammar's masks computed ahead,
`GrammarProcessor.masks_ahead`; a penalty called with the drafts' context): on the CPU every
row's tokens and logprob vectors equal those of the same batch without speculation, drafts are
kept, and the output follows the schema — on the batch runner and on the fast runner (L3, its
verify one fast step). Negative control: the verify positions left unmasked change the
logprob vectors. Alone (max_batch 1) a grammar request still decodes without speculation."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import pytest

import engine
from engine import Engine, SamplingParams
from engine.constrained import parse_response_format, response_format_factory
from engine.step import batch_lookup
from starter.models import ensure_fixture

SCHEMA = {"type": "object", "properties": {
    "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 2, "maxItems": 6},
    "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ids", "color"]}
EXAMPLE = '{"ids": [1, 2, 3, 4], "color": "green"} ' * 3
USER = [{"role": "user", "content": f"Like this: {EXAMPLE} Give me the data."}]
NO_THINK = {"enable_thinking": False}


@pytest.fixture(scope="module")
def models():
    m, tok = engine.load(ensure_fixture("qwen3"))
    d, _ = engine.load(ensure_fixture("qwen3", "q4"))
    return m, tok, d


def _factory(tok):
    fmt = parse_response_format({"type": "json_schema",
                                 "json_schema": {"name": "o", "schema": SCHEMA, "strict": True}})
    return response_format_factory(tok, fmt)


def _run(eng, params_list, errors=None):
    rids = [eng.submit(USER, p, template_kwargs=NO_THINK) for p in params_list]
    out = {r: ["", [], []] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            if errors is not None and o.error is not None:
                errors.append(o.error)
            assert errors is not None or o.error is None, o.error
            out[o.request_id][0] += o.text
            out[o.request_id][1] += o.token_ids
            out[o.request_id][2] += o.logprob_arrays
    return [out[r] for r in rids]


def _same(a, b) -> bool:
    return (a[1] == b[1] and len(a[2]) == len(b[2])
            and all(mx.array_equal(x, y).item() for x, y in zip(a[2], b[2])))


def _params(tok, **kw):
    return SamplingParams(max_tokens=40, temperature=0.0, processor_factories=(_factory(tok),),
                          **kw)


def _plain_and_spec(m, tok, d, source, errors=None, tier="l1"):
    """(rows without speculation, the same rows speculating: two grammar rows, one plain);
    tier l3: the rows on the fast runner (each verify one fast step, engine.fast.slots)."""
    from engine.levers import resolve
    runs = []
    for on in (False, True):
        eng = Engine(m, tok, max_batch=4, prompt_cache=None, keep_logprob_arrays=True,
                     draft_model=d if source == "draft" else None,
                     levers=resolve("l3") if tier == "l3" else None)
        spec = ({"prompt_lookup": 2 if on else 0, "num_draft_tokens": 4} if source == "lookup"
                else {"use_draft": on, "num_draft_tokens": 3})
        pen = dict(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.5,
                   logit_bias={5: -2.0, 7: 1.5})
        rows = [_params(tok, **spec), _params(tok, **spec),
                SamplingParams(max_tokens=20, temperature=0.0, **spec),
                SamplingParams(max_tokens=30, temperature=0.0, **pen, **spec),   # penalties
                _params(tok, **pen, **spec)]                           # penalties + grammar
        if source == "draft":     # a seeded sampled grammar row too (mlx-lm's exact scheme)
            rows.append(SamplingParams(max_tokens=30, temperature=0.7, seed=5, **spec,
                                       processor_factories=(_factory(tok),)))
        runs.append((_run(eng, rows, errors if on else None), eng.stats()["speculation"]))
    return runs


@pytest.mark.parametrize("tier", ["l1", "l3"])
@pytest.mark.parametrize("source", ["lookup", "draft"])
def test_processed_rows_speculate_with_the_logits_of_plain_decoding(models, source, tier):
    m, tok, d = models
    (plain, _), (spec, counts) = _plain_and_spec(m, tok, d, source, tier=tier)
    for a, b in zip(plain, spec):
        assert _same(a, b)
    for text, _, _ in spec[:2] + spec[4:]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert counts[source]["drafted"] > 0 and counts[source]["accepted"] > 0


def test_unmasked_verify_positions_are_caught(models, monkeypatch):
    m, tok, d = models
    """The verify positions after the first left unmasked: drafts the grammar forbids are
    kept (the grammar then fails the row) or the logprob vectors differ."""
    monkeypatch.setattr(batch_lookup, "processed_positions", lambda lp, *a: lp)
    errors = []
    (plain, _), (spec, _) = _plain_and_spec(m, tok, d, "draft", errors)
    assert errors or not all(_same(a, b) for a, b in zip(plain[:2], spec[:2]))


def test_alone_a_grammar_request_does_not_speculate(models):
    m, tok, d = models
    eng = Engine(m, tok, max_batch=1, prompt_cache=None, draft_model=d)
    text, _, _ = _run(eng, [_params(tok, num_draft_tokens=3)])[0]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert eng.stats()["speculation"]["draft"]["drafted"] == 0
