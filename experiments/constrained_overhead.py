"""Constrained decoding: which library, and what it costs per token.

    python experiments/constrained_overhead.py --quick          # ~2 min on 2 CPU cores
    python experiments/constrained_overhead.py --tokens 128 --reps 5 --tag my-run

Part 1 — libraries, on the same tokenizers (the qwen3 fixture's 1024-token BPE
and a 16384-token BPE trained here the same way), for each schema of a
coverage set: does the library compile it, does it accept a valid instance
and reject an invalid one (the negative control: a library that accepts both
does not enforce the feature), and the mean time per token to compute the
next-token mask and advance by the token (walking the valid instance).
Candidates: llguidance, outlines-core, xgrammar; a library that cannot be
imported is reported with the reason (xgrammar imports torch).

Part 2 — the engine: decode time per token with `engine.constrained`'s
processor (llguidance) against the same run without it, at B=1 (the serial
token loop, `engine.step.stepper.generate_step`) and B=8 (`BatchScheduler`, one
processor per row), on the qwen3 fixture, greedy, over a schema that cannot
complete within the run (so every step computes a real mask). The overhead is
(constrained - free) per token, in microseconds, and as a ratio, each from the
fastest of the reps (other work on a shared machine only adds time).

Writes constrained_overhead.{md,json} and libraries.csv / engine.csv to
reports/constrained_overhead/<version>/<tag>/ (or --out). `processor_us_per_call` is the
processor's own host cost per row and token (no model, so not affected by
how busy the machine is with other work): the part of the overhead that
does not depend on the pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments._common import dump_json, machine, md_table, report_dir  # noqa: E402

SEP = {"separators": (", ", ": ")}

# (name, schema, a valid instance, an invalid instance)
CASES = [
    ("flat_required", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {
        "type": "string"}}, "required": ["a", "b"], "additionalProperties": False},
     {"a": 5, "b": "x"}, {"a": 5}),
    ("nested", {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "q": {"type": "boolean"}}, "required": ["q"], "additionalProperties": False}},
        "required": ["p"], "additionalProperties": False},
     {"p": {"q": True}}, {"p": {"q": 1}}),
    ("enum", {"type": "object", "properties": {"c": {"enum": ["red", "green"]}},
              "required": ["c"], "additionalProperties": False},
     {"c": "green"}, {"c": "blue"}),
    ("int_range", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                          "maximum": 12}},
                   "required": ["n"], "additionalProperties": False},
     {"n": 12}, {"n": 13}),
    ("number", {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
                "additionalProperties": False},
     {"x": -1.5e3}, {"x": "1"}),
    ("pattern", {"type": "object", "properties": {"z": {"type": "string",
                                                        "pattern": "^[0-9]{5}$"}},
                 "required": ["z"], "additionalProperties": False},
     {"z": "12345"}, {"z": "1234a"}),
    ("array_bounds", {"type": "object", "properties": {"t": {"type": "array", "items": {
        "type": "integer"}, "minItems": 2, "maxItems": 3}}, "required": ["t"],
        "additionalProperties": False},
     {"t": [1, 2]}, {"t": [1]}),
    ("string_length", {"type": "object", "properties": {"s": {"type": "string", "minLength": 2,
                                                              "maxLength": 4}},
                       "required": ["s"], "additionalProperties": False},
     {"s": "abc"}, {"s": "abcde"}),
    ("anyof", {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {
        "type": "null"}]}}, "required": ["v"], "additionalProperties": False},
     {"v": None}, {"v": "x"}),
    ("ref_defs", {"type": "object", "$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}},
        "properties": {"a": {"$ref": "#/$defs/pt"}}, "required": ["a"],
        "additionalProperties": False},
     {"a": {"x": 1}}, {"a": {"y": 1}}),
    ("const", {"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"],
               "additionalProperties": False},
     {"k": "fixed"}, {"k": "other"}),
    ("optional_props", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {
        "type": "integer"}}, "required": ["b"], "additionalProperties": False},
     {"b": 2}, {"a": 1}),
]


# ------------------------------------------------------------------ libraries

def _byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        from engine.constrained import ll_tokenizer
        self.tok, self.lt = tok, ll_tokenizer(tok)
        self.words = np.zeros((self.lt.vocab_size + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        import llguidance
        g = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ",
                              "key_separator": ": "})
        m = llguidance.LLMatcher(self.lt, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def step(self, m, token):
        m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        allowed = bool((self.words[token // 32] >> (token % 32)) & 1)
        return allowed and m.consume_token(token)

    def accepting(self, m):
        return m.is_accepting()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok):
        import outlines_core as oc
        dec = _byte_decoder()
        vocab = {}
        eos = min(tok.eos_token_ids)
        for i in range(tok.vocab_size):
            if i in tok.eos_token_ids:
                continue
            if i in tok.added_tokens:
                raw = tok.added_tokens[i].encode()
            else:
                piece = tok.backend.id_to_token(i)
                raw = bytes(dec[c] for c in piece)
            vocab.setdefault(raw, []).append(i)
        self.oc, self.vocab = oc, oc.Vocabulary(eos, vocab)
        self.mask = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def step(self, g, token):
        g.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)
        if not (self.mask[token // 32] >> (token % 32)) & 1:
            return False
        g.advance(token)
        return True

    def accepting(self, g):
        return g.is_finished()


def _libraries():
    libs, missing = [LLGuidance], {}
    try:
        import outlines_core  # noqa: F401
        libs.append(OutlinesCore)
    except ImportError as e:
        missing["outlines-core"] = f"cannot import: {e}"
    try:
        import xgrammar  # noqa: F401
        missing["xgrammar"] = "importable, but no adapter written (it needs torch tensors)"
    except Exception as e:  # the wheel imports torch at import time
        missing["xgrammar"] = (f"cannot import ({type(e).__name__}: {e}); xgrammar 0.2.9's wheel "
                               "requires torch and triton and imports torch when imported")
    return libs, missing


def _walk(lib, state, ids):
    for t in ids:
        if not lib.step(state, t):
            return False
    return lib.accepting(state)


def run_libraries(tokenizers, reps):
    rows = []
    libs, missing = _libraries()
    for tok_name, tok in tokenizers.items():
        for cls in libs:
            t0 = time.perf_counter()
            lib = cls(tok)
            setup = time.perf_counter() - t0
            for case, schema, good, bad in CASES:
                row = dict(library=cls.name, tokenizer=tok_name, schema=case,
                           vocab_setup_s=round(setup, 3))
                try:
                    t0 = time.perf_counter()
                    lib.compile(schema)
                    row["compile_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
                except Exception as e:
                    row.update(compiles=False, error=str(e).splitlines()[0][:120])
                    rows.append(row)
                    continue
                good_ids = tok.encode(json.dumps(good, **SEP), add_special_tokens=False)
                bad_ids = tok.encode(json.dumps(bad, **SEP), add_special_tokens=False)
                times = []
                for _ in range(reps):
                    st = lib.compile(schema)
                    t0 = time.perf_counter()
                    ok = _walk(lib, st, good_ids)
                    times.append((time.perf_counter() - t0) / len(good_ids))
                row.update(compiles=True, accepts_valid=ok,
                           rejects_invalid=not _walk(lib, lib.compile(schema), bad_ids),
                           us_per_token=round(1e6 * float(np.median(times)), 2))
                rows.append(row)
    return pd.DataFrame(rows), missing


# --------------------------------------------------------------------- engine

LONG = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"]}}


def run_engine(tokens, reps, preset=None):
    import mlx.core as mx

    import engine
    from engine.step.batch import BatchRequest, BatchScheduler
    from engine.constrained import ResponseFormat, response_format_processor
    from engine.step.stepper import generate_step
    from starter.models import ensure_fixture

    if preset:
        from experiments.presets import build_preset
        path = build_preset(preset, Path(tempfile.mkdtemp(prefix=f"{preset}-")))
    else:
        path = ensure_fixture("qwen3")
    model, tok = engine.load(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "list"}], enable_thinking=False)
    fmt = ResponseFormat("json_schema", LONG)

    def serial(constrained):
        procs = [response_format_processor(tok, fmt)] if constrained else None
        t0 = time.perf_counter()
        n = sum(1 for _ in generate_step(mx.array(prompt), model, max_tokens=tokens,
                                         logits_processors=procs))
        return (time.perf_counter() - t0) / n, n

    def batch(constrained, b=8):
        sched = BatchScheduler(model, eos_token_ids=())
        for _ in range(b):
            procs = [response_format_processor(tok, fmt)] if constrained else ()
            sched.submit(BatchRequest(prompt, max_tokens=tokens, logits_processors=procs))
        n, t0 = 0, time.perf_counter()
        for ev in sched.run():
            n += ev.token is not None
        return (time.perf_counter() - t0) / n, n

    def processor_only(n):
        """Host cost of one processor call (advance + mask + where), no model:
        greedy over fixed random logits, minus the same loop without it."""
        logits = mx.random.normal((1, model_vocab), key=mx.random.key(0))
        mx.eval(logits)

        def loop(proc):
            hist = list(prompt)
            t0 = time.perf_counter()
            for _ in range(n):
                out = proc(mx.array(hist), logits) if proc else logits
                hist.append(mx.argmax(out, axis=-1).item())
            return (time.perf_counter() - t0) / n
        return loop(response_format_processor(tok, fmt)) - loop(None)

    model_vocab = model(mx.array([prompt[:1]])).shape[-1]
    rows = []
    for b, fn in ((1, serial), (8, batch)):
        fn(False), fn(True)   # warm-up (compiles, first-call costs)
        for rep in range(reps):
            free, n_free = fn(False)
            con, n_con = fn(True)
            rows.append(dict(B=b, rep=rep, tokens=n_con, free_us_per_token=1e6 * free,
                             constrained_us_per_token=1e6 * con,
                             overhead_us_per_token=1e6 * (con - free), ratio=con / free,
                             processor_us_per_call=1e6 * processor_only(tokens)))
    df = pd.DataFrame(rows)
    # the fastest rep of each: other work on a shared machine only ever adds time
    summary = df.groupby("B").agg(
        tokens=("tokens", "first"), free_us_per_token=("free_us_per_token", "min"),
        constrained_us_per_token=("constrained_us_per_token", "min"),
        processor_us_per_call=("processor_us_per_call", "min")).round(1)
    summary["overhead_us_per_token"] = (summary.constrained_us_per_token
                                        - summary.free_us_per_token).round(1)
    summary["ratio"] = (summary.constrained_us_per_token / summary.free_us_per_token).round(2)
    return df, summary


def _md(df: pd.DataFrame) -> str:
    df = df.reset_index() if not isinstance(df.index, pd.RangeIndex) else df
    return md_table(list(df.columns), df.fillna("").values.tolist())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps and tokens")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tag", default="cpu-fixtures")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--preset", help="engine part on a random model of this shape "
                    "(experiments/presets.py, e.g. 1b: vocab 32000) instead of the qwen3 fixture")
    ap.add_argument("--skip-libraries", action="store_true", help="engine part only")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.reps = 64, 3

    if args.skip_libraries:
        libs = pd.DataFrame(columns=["library", "tokenizer", "schema", "compiles", "accepts_valid",
                                     "rejects_invalid", "us_per_token"])
        missing = {"all": "--skip-libraries"}
    else:
        from engine.text.tokenizer import load_tokenizer
        from starter.models import ensure_fixture
        from starter.tokenizers import build_tokenizer
        big = Path(tempfile.mkdtemp(prefix="bpe16k-"))
        build_tokenizer(big, "qwen3", 16384)
        tokenizers = {"qwen3-1024": load_tokenizer(ensure_fixture("qwen3")),
                      "qwen3-bpe-16384": load_tokenizer(big)}
        libs, missing = run_libraries(tokenizers, args.reps)
    per_token, summary = run_engine(args.tokens, args.reps, args.preset)

    out = args.out or report_dir("constrained_overhead", args.tag)
    out.mkdir(parents=True, exist_ok=True)
    libs.to_csv(out / "libraries.csv", index=False)
    per_token.to_csv(out / "engine.csv", index=False)
    cov = libs if libs.empty else libs.groupby(["library", "tokenizer"]).agg(
        compiles=("compiles", "sum"), accepts_valid=("accepts_valid", "sum"),
        rejects_invalid=("rejects_invalid", "sum"),
        median_us_per_token=("us_per_token", "median"))
    cmd = "python experiments/constrained_overhead.py " + " ".join(argv or sys.argv[1:])
    md = [f"# Constrained decoding overhead ({args.tag})", "", f"Command: `{cmd}`", "",
          f"Machine: {json.dumps(machine())}", "",
          f"## Libraries ({len(CASES)} schemas)", "", _md(cov), "",
          "Not measured: " + "; ".join(f"{k}: {v}" for k, v in missing.items()), "",
          "### Per schema", "", _md(libs), "",
          f"## Engine ({args.preset or 'qwen3 fixture'}, greedy, {args.tokens} tokens, "
          f"fastest of {args.reps} reps; load average at the end {os.getloadavg()})",
          "", _md(summary), ""]
    (out / "constrained_overhead.md").write_text("\n".join(md))
    dump_json(out / "constrained_overhead.json", {
        "command": cmd, "machine": machine(), "missing": missing,
        "coverage": cov.reset_index().to_dict(orient="records"),
        "engine": summary.reset_index().to_dict(orient="records")})
    print("\n".join(md))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
