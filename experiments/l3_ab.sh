#!/bin/bash
# Device run: the one-kernel step's load depth A/B, 4-bit weights, and the batch lane.
#   1. experiments/l3_overhead.py (mode l3) on 1b and 8b at prompt 128, with the mega
#      kernel's weight loads in flight per lane at 8/4 (single/paired rows, the default)
#      and 16/8 (MLXP_MEGA_UN1 / MLXP_MEGA_UN2);
#   2. experiments/bench_decode.py l1,l3 on 1b with 4-bit weights, the fused quantized GEMV
#      on (MLXP_QGEMV=1);
#   3. experiments/merged_exactness.py: the batch lane at 8 and 32 rows against BatchGenerator;
#   UN_MODELS= (empty), Q4=0, BATCH=0 leave stages 1, 2, 3 out.
#   OUT=/tmp/ab BUDGET=480 bash experiments/l3_ab.sh
set -u
OUT=${OUT:-/tmp/ab}
BUDGET=${BUDGET:-480}
source "$(dirname "$0")/stages.sh"
{
stage build
python3 -m experiments.presets 1b /tmp/m/1b
python3 -m experiments.presets 8b /tmp/m/8b
python3 -m experiments.presets 1b /tmp/m/1b-q4 --bits 4
for m in ${UN_MODELS-1b 8b}; do
  for un in "8 4" "16 8"; do
    set -- $un
    stage "un-$m-$1-$2"
    MLXP_MEGA_UN1=$1 MLXP_MEGA_UN2=$2 run $(lim 300 60) python3 experiments/l3_overhead.py --model /tmp/m/$m \
      --modes l3 --trials 5 --out "$OUT/un_${m}_$1_$2.jsonl"
  done
done
[ "${Q4:-1}" = 1 ] && stage bench-q4 && MLXP_QGEMV=1 run $(lim 200 100) python3 experiments/bench_decode.py --model /tmp/m/1b-q4 --tier l1,l3 \
  --lengths 128,2048 --gen 64 --trials 5 --tag h200-q4-qgemv --out "$OUT/bench-q4"
[ "${BATCH:-1}" = 1 ] && stage batch && run $(lim 3 240) python3 experiments/merged_exactness.py --model /tmp/m/1b \
  --specs l1+merged_proj,l3+fast_batch --batches 8,32 --trials 3 --out "$OUT/batch.jsonl"
stage done
} 2>&1 | tee "$OUT/ab.log"
