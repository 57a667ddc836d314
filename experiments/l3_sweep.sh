#!/bin/bash
# Device run: (CHECK2048=0 leaves out) experiments/mega_check.py on the presets CHECK_MODELS
# (default 1b) at the prompts CHECK_PROMPTS (default 2048), with the settings CHECK_ENV
# (the attention combine over 33+ chunks against L1), then with BENCH1=N N runs of
# bench_decode l1,l3 on the 1b preset, with BENCH8=N N runs of bench_decode l1,l3 on the 8b
# preset, with MMA=1 the 4-bit tensor-core probe (experiments/qmm_probe.py) and with NCU=1 Nsight
# Compute on the 8b step (experiments/l3_ncu.sh); DEV (default h200) begins the benches' tags;
# BATCHCHK=1 then checks the batch lane; OVERHEAD=1 (before the benches)
# times what a step costs around the kernel (experiments/step_overhead.py). Results under $OUT.
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
  for M in ${CHECK_MODELS:-1b}; do    # (CHECK_ENV: settings for the kernel, e.g. MLXP_MEGA_PROF=1)
  for P in ${CHECK_PROMPTS:-2048}; do
    stage check-$M-$P
    run $(lim 60 90) env ${CHECK_ENV:-} python3 experiments/mega_check.py --model /tmp/m/$M --prompt $P \
      --steps 8 --out "$OUT/mega_check_${M}_$P.json"
  done
  done
fi
if [ "${OVERHEAD:-0}" = 1 ]; then      # what a step costs around the kernel (1b and 8b, prompt 128)
  for M in 1b 8b; do
    stage overhead-$M
    run $(lim 40 60) python3 experiments/step_overhead.py --model /tmp/m/$M --prompt 128 --ops \
      --out "$OUT/step_overhead_$M.json"
  done
fi
for R in $(seq 1 "${BENCH1:-0}"); do    # BENCH1=N: N bench runs on the 1b preset, defaults
  stage bench-1b-$R
  run $(lim 40 130) python3 experiments/bench_decode.py --model /tmp/m/1b \
    --tier l1,l3 --lengths 128,2048 --gen 64 --trials 5 --tag ${DEV:-h200}-1b-r$R --out "$OUT/bench-1b-r$R"
done
for R in $(seq 1 "${BENCH8:-0}"); do    # BENCH8=N: N bench runs on the 8b preset
  stage bench-8b-$R
  run $(lim 40 160) python3 experiments/bench_decode.py --model /tmp/m/8b \
    --tier l1,l3 --lengths 128,2048 --gen 64 --trials 5 --tag ${DEV:-h200}-8b-r$R --out "$OUT/bench-8b-r$R"
done
if [ "${BATCHCHK:-0}" = 1 ]; then      # the batch lane (8 and 32 rows) against BatchGenerator
  stage batch
  run $(lim 5 100) python3 experiments/merged_exactness.py --model /tmp/m/1b \
    --specs l3 --batches 8,32 --trials 3 --out "$OUT/batch.jsonl"
fi
if [ "${MMA:-0}" = 1 ]; then
  stage mma
  run $(lim 5 150) python3 experiments/qmm_probe.py --out "$OUT/qmm"
fi
if [ "${NCU:-0}" = 1 ]; then
  stage ncu
  MODELS=8b OUT=$OUT/ncu BUDGET=$(lim 5 200) bash experiments/l3_ncu.sh
fi
stage done
} 2>&1 | tee "$OUT/sweep.log"
