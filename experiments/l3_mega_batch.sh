#!/bin/bash
# Device run: the one-kernel step in the batch lane (results under $OUT):
#   1. experiments/mega_check.py: the solo step still agrees with the step of separate kernels;
#   2. experiments/merged_exactness.py: the batch lane at 8 and 32 rows against BatchGenerator;
#   3. experiments/trained_gate.py --gate-batch 8: the gate on a trained 1b, solo and batch rows.
#   OUT=/tmp/mb BUDGET=250 bash experiments/l3_mega_batch.sh
set -u
OUT=${OUT:-/tmp/mb}
BUDGET=${BUDGET:-250}
source "$(dirname "$0")/stages.sh"
{
stage build
python3 -m experiments.presets 1b /tmp/m/1b
stage check
run $(lim 200 45) python3 experiments/mega_check.py --model /tmp/m/1b --steps 16 --out "$OUT/mega_check.json"
stage batch
run $(lim 110 100) python3 experiments/merged_exactness.py --model /tmp/m/1b \
  --specs l3 --batches 8,32 --trials 3 --out "$OUT/batch.jsonl"
stage trained-gate
run $(lim 2 320) python3 experiments/trained_gate.py --preset 1b --steps ${TRAINED_STEPS:-500} --gate-batch 8 \
  --out /tmp/trained
mkdir -p "$OUT/trained" && cp -r /tmp/trained/gate /tmp/trained/train.json "$OUT/trained/" 2>/dev/null
stage done
} 2>&1 | tee "$OUT/mb.log"
