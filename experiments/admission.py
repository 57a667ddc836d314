"""Admission check: predicted peak memory vs measured `mx.get_peak_memory`.

For each model, context length and KV mode: load the model, reset the peak
counter, prefill T-1 tokens and decode a few, and compare the measured peak
with `Admission.predicted_peak(T)`. Target: within ±15%, never under by more
than 5% (an under-prediction is what lets an OOM through).

    python experiments/admission.py --quick             # CPU fixtures
    python experiments/admission.py --model DIR --contexts 2048,8192,32768 --tag h200-1b

Writes CSV + markdown to reports/admission/<version>/<tag>/.
"""

from __future__ import annotations

import argparse
import csv
import gc
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402
from engine.step.admission import Admission  # noqa: E402
from engine.kv.quant import make_policy  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.step.stepper import generate_step  # noqa: E402


def measure(model_dir, contexts, modes):
    rows = []
    for mode in modes:
        for T in contexts:
            gc.collect()
            mx.clear_cache()
            model = load_model(model_dir)[0]
            kv = {} if mode == "float" else {"kv_bits": int(mode[2:]), "kv_group_size": 32}
            policy = make_policy(model, **kv)
            adm = Admission.for_model(model, budget_bytes=1 << 40, policy=policy)
            predicted = adm.predicted_peak(T)
            vocab = model.args.vocab_size
            prompt = np.random.default_rng(T).integers(32, min(vocab, 1000) - 1, size=T - 4).tolist()
            mx.synchronize()
            mx.reset_peak_memory()
            for _ in generate_step(mx.array(prompt), model, max_tokens=4, policy=policy):
                pass
            mx.synchronize()
            peak = mx.get_peak_memory()
            err = (predicted - peak) / peak
            rows.append({"model": Path(model_dir).name, "mode": mode, "context": T,
                         "weights_bytes": adm.weights, "predicted_bytes": predicted,
                         "measured_peak_bytes": peak, "rel_error": err,
                         "within_15pct": abs(err) <= 0.15, "under_by_more_than_5pct": err < -0.05})
            print(rows[-1], flush=True)
            del model
    return rows


def write(rows, out: Path, note: str):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "admission.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ok = sum(r["within_15pct"] for r in rows)
    under = sum(r["under_by_more_than_5pct"] for r in rows)
    lines = [f"# Admission: predicted vs measured peak — mlx-parity {engine.__version__}", "", note, "",
             f"{ok}/{len(rows)} within ±15%; {under} under-predicted by more than 5%.", "",
             "| model | KV | context | predicted MB | measured MB | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['context']} | {r['predicted_bytes'] / 1e6:.2f} | "
                     f"{r['measured_peak_bytes'] / 1e6:.2f} | {r['rel_error']:+.1%} |")
    (out / "admission.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--modes", default="float,kv8,kv4")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    models = a.model or []
    if a.quick or not models:
        from parity.fixtures.models import ensure_fixture
        models += [str(ensure_fixture(f, "bfloat16")) for f in ("llama", "gemma4_text")]
    rows = []
    for m in models:
        rows += measure(m, [int(x) for x in a.contexts.split(",")], a.modes.split(","))
    tag = a.tag or "cpu-fixtures"
    out = Path(a.out) if a.out else REPO / "reports" / "admission" / engine.__version__ / tag
    write(rows, out, f"Device {mx.default_device()}. Reproduce: `python experiments/admission.py "
                     f"{' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
