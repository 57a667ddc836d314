#!/bin/bash
# The one-kernel L3 step (engine.fast.mega) on the device, results under $OUT:
#   1. its logits against the step of separate kernels and L1 (experiments/mega_check.py);
#   2. the gate on the 1b preset (teacher-forced KL / top-1 vs L1, faults must fail);
#   3. experiments/l3_overhead.py: l1, l3 (one kernel), l3 emptied, l3 without it, at 128 and 2048;
#   4. experiments/bench_decode.py l1,l3 on 1b (and on 8b with MODELS="1b 8b");
#   5. with TRAINED=1, experiments/trained_gate.py (TRAINED_STEPS) in the time left;
#   (QUANT=1 ran the 4-bit 1b through the kernel; 4-bit models left the kernel at 0.5.2: reports/l3/JOURNAL.md)
#   OUT=/tmp/mega BUDGET=520 bash experiments/l3_mega_probe.sh
set -u
OUT=${OUT:-/tmp/mega}
BUDGET=${BUDGET:-520}
source "$(dirname "$0")/stages.sh"
{
stage build
for m in ${MODELS:-1b}; do python3 -m experiments.presets "$m" "/tmp/m/$m"; done
stage check
MLXP_MEGA_PROF=1 run $(lim 400 90) python3 experiments/mega_check.py --model /tmp/m/1b --steps 24 --out "$OUT/mega_check.json"
MLXP_MEGA_PROF=1 run $(lim 380 60) python3 experiments/mega_check.py --model /tmp/m/1b --steps 8 --prompt 2048 \
  --out "$OUT/mega_check_2048.json"
stage gate
run $(lim 300 ${GATE_S:-120}) python3 -m parity.l3_gate --model /tmp/m/1b --prompts ${GATE_PROMPTS:-4} \
  --batch 0 --tag h200-1b-mega --out "$OUT/gate"
stage overhead-128
run $(lim 200 70) python3 experiments/l3_overhead.py --model /tmp/m/1b --modes l1,l3,l3-empty,l3-nomega \
  --trials 3 --out "$OUT/overhead_128.jsonl"
stage overhead-2048
run $(lim 150 70) python3 experiments/l3_overhead.py --model /tmp/m/1b --prompt 2048 \
  --modes l1,l3,l3-nomega --trials 3 --out "$OUT/overhead_2048.jsonl"
stage bench
MARGS=""; for m in ${MODELS:-1b}; do MARGS="$MARGS --model /tmp/m/$m"; done
run $(lim ${BENCH_RESERVE:-5} 240) python3 experiments/bench_decode.py $MARGS --tier l1,l3 --lengths 128,2048 \
  --gen ${GEN:-64} --trials 5 --tag h200-mega --out "$OUT/bench"
if [ "${TRAINED:-0}" = 1 ]; then
  stage trained-gate
  run $(lim 3 400) python3 experiments/trained_gate.py --preset 1b --steps ${TRAINED_STEPS:-500} --out /tmp/trained
  mkdir -p "$OUT/trained" && cp -r /tmp/trained/gate /tmp/trained/train.json "$OUT/trained/" 2>/dev/null
fi
stage done
} 2>&1 | tee "$OUT/probe.log"
