#!/bin/bash
# Device run: the one-kernel step after its shared-memory input reads became 16-byte loads
# (swizzled for quantized weights), results under $OUT:
#   1. experiments/mega_check.py with the phase timer: 1b bf16, 1b 4-bit with quantized
#      values made floats by bit tricks (MLXP_MEGA_QMAGIC=1) and by conversions (=0), 8b bf16;
#   2. experiments/bench_decode.py l1,l3 on 1b 4-bit (MLXP_MEGA_QUANT=1) and 1b bf16;
#   3. experiments/l3_overhead.py l1,l3 on 8b;
#   4. experiments/merged_exactness.py: the batch lane at 8 and 32 rows, and at 32 rows the
#      one-kernel step in several calls (MLXP_MEGA_MULTI=1).
#   OUT=/tmp/qp BUDGET=480 bash experiments/l3_quant_probe.sh
set -u
OUT=${OUT:-/tmp/qp}
BUDGET=${BUDGET:-480}
source "$(dirname "$0")/stages.sh"
{
stage build
python3 -m experiments.presets 1b /tmp/m/1b
python3 -m experiments.presets 1b /tmp/m/1b-q4 --bits 4
python3 -m experiments.presets 8b /tmp/m/8b
stage check-bf16
MLXP_MEGA_PROF=1 run $(lim 400 60) python3 experiments/mega_check.py --model /tmp/m/1b --steps 16 \
  --out "$OUT/mega_check_1b.json"
for qm in 1 0; do
  stage "check-q4-qmagic$qm"
  MLXP_MEGA_QUANT=1 MLXP_MEGA_QMAGIC=$qm MLXP_MEGA_PROF=1 run $(lim 380 60) python3 experiments/mega_check.py \
    --model /tmp/m/1b-q4 --steps 16 --out "$OUT/mega_check_q4_qmagic$qm.json"
done
stage bench-q4
MLXP_MEGA_QUANT=1 run $(lim 300 110) python3 experiments/bench_decode.py --model /tmp/m/1b-q4 --tier l1,l3 \
  --lengths 128,2048 --gen 64 --trials 5 --tag h200-q4-mega --out "$OUT/bench-q4"
stage bench-1b
run $(lim 220 90) python3 experiments/bench_decode.py --model /tmp/m/1b --tier l1,l3 \
  --lengths 128,2048 --gen 64 --trials 5 --tag h200-mega --out "$OUT/bench"
stage 8b
MLXP_MEGA_PROF=1 run $(lim 150 60) python3 experiments/mega_check.py --model /tmp/m/8b --steps 8 \
  --out "$OUT/mega_check_8b.json"
run $(lim 100 70) python3 experiments/l3_overhead.py --model /tmp/m/8b --modes l1,l3 --trials 3 \
  --out "$OUT/overhead_8b.jsonl"
stage batch
run $(lim 45 120) python3 experiments/merged_exactness.py --model /tmp/m/1b --specs l3+fast_batch \
  --batches 8,32 --trials 3 --out "$OUT/batch.jsonl"
MLXP_MEGA_MULTI=1 run $(lim 3 60) python3 experiments/merged_exactness.py --model /tmp/m/1b \
  --specs l3+fast_batch --batches 32 --trials 3 --out "$OUT/batch32_multi.jsonl"
stage done
} 2>&1 | tee "$OUT/qp.log"
