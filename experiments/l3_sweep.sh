#!/bin/bash
# Device run: (CHECK2048=0 leaves out) experiments/mega_check.py on the 1b preset at prompt 2048
# (the attention combine over 33+ chunks against L1); the one-kernel step's switches A/B
# (experiments/mega_sweep.py) on the 8b preset
# (VARIANTS8, prompts 128 and 2048) and the 1b preset (VARIANTS1), then with BENCH8=1
# bench_decode l1,l3 on the 8b preset (MLXP_MEGA_OPT=$BENCH_OPT), with MMA=1 the
# tensor-core probe (experiments/mma_probe.py) and with NCU=1 Nsight Compute on the 8b step
# (experiments/l3_ncu.sh, MLXP_MEGA_OPT as set). Results under $OUT.
#   OUT=/tmp/sw BUDGET=540 bash experiments/l3_sweep.sh
set -u
OUT=${OUT:-/tmp/sw}
BUDGET=${BUDGET:-540}
source "$(dirname "$0")/stages.sh"
{
stage build
python3 -m experiments.presets 8b /tmp/m/8b
python3 -m experiments.presets 1b /tmp/m/1b
if [ "${CHECK2048:-1}" = 1 ]; then     # the kernel against L1 with more than 32 attention chunks
  stage check-2048
  run $(lim 60 90) python3 experiments/mega_check.py --model /tmp/m/1b --prompt 2048 --steps 8 \
    --out "$OUT/mega_check_1b_2048.json"
fi
stage sweep-8b
run $(lim 60 ${SW8_S:-300}) python3 experiments/mega_sweep.py --model /tmp/m/8b \
  --variants "${VARIANTS8:-20,52,53,60,20:un1=16}" --prompts 128,2048 --out "$OUT/sweep_8b.json"
stage sweep-1b
run $(lim 30 ${SW1_S:-120}) python3 experiments/mega_sweep.py --model /tmp/m/1b \
  --variants "${VARIANTS1:-20,52,53}" --prompts 128,2048 --out "$OUT/sweep_1b.json"
if [ "${BENCH8:-0}" = 1 ]; then
  stage bench-8b
  MLXP_MEGA_OPT=${BENCH_OPT:-} run $(lim 40 160) python3 experiments/bench_decode.py --model /tmp/m/8b \
    --tier l1,l3 --lengths 128,2048 --gen 64 --trials 5 --tag h200-8b-opt${BENCH_OPT:-} --out "$OUT/bench-8b"
fi
if [ "${MMA:-0}" = 1 ]; then
  stage mma
  run $(lim 5 150) python3 experiments/mma_probe.py --out "$OUT/mma"
fi
if [ "${NCU:-0}" = 1 ]; then
  stage ncu
  MODELS=8b OUT=$OUT/ncu BUDGET=$(lim 5 200) bash experiments/l3_ncu.sh
fi
stage done
} 2>&1 | tee "$OUT/sweep.log"
