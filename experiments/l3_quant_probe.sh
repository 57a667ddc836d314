#!/bin/bash
# Device run: the one-kernel step after its shared-memory input reads became 16-byte loads
# (swizzled for quantized weights), results under $OUT:
#   1. experiments/mega_check.py with the phase timer on 1b 4-bit (CHECKQ4=0 leaves out),
#      then (BENCHQ4=0 leaves out) bench_decode l1,l3 on it;
#   2. with TRAINED=1: experiments/trained_gate.py (TRAINED_STEPS), the gate on a trained 1b
#      in bf16, its batch lane (8 rows) and the same model quantized to 4 bits;
#   3. (CHECK1B=0 leaves out) mega_check on 1b bf16;
#   4. (BENCH1B=0 leaves out) bench_decode l1,l3 on 1b bf16;
#   5. (E8B=0 leaves out) bench_decode l1,l3, mega_check and experiments/l3_overhead.py l1,l3 on 8b;
#   6. with Q8=1: 1b with 8-bit weights through the kernel (the default since 0.5.2), and with
#      QWEN3=1 the qwen3-2b preset (per-head q/k norms in the kernel):
#      each mega_check, then bench_decode l1,l3;
#   7. (MMA=1 ran experiments/mma_probe.py, the bf16 tensor-core GEMV probe; deleted at 0.5.0, see git history)
#   8. (BATCH=0 leaves out) experiments/merged_exactness.py: the batch lane at 8 and 32 rows,
#      then at 32 rows the step of separate kernels with MLX's matmuls instead of the GEMV (MLXP_DISABLE_KERNELS=gemv)
#      next to the bit-exact merged-projection step.
#   9. with PROFB=1: experiments/batch_profile.py, where an Engine step of 8 and 32 rows spends its time.
# Each stage gets what is left of BUDGET, capped (Q8BENCH=0: the 8-bit check without its bench).
#   OUT=/tmp/qp BUDGET=480 bash experiments/l3_quant_probe.sh
set -u
OUT=${OUT:-/tmp/qp}
BUDGET=${BUDGET:-480}
source "$(dirname "$0")/stages.sh"
{
stage build
python3 -m experiments.presets 1b /tmp/m/1b
python3 -m experiments.presets 1b /tmp/m/1b-q4 --bits 4
[ "${E8B:-1}" = 1 ] && python3 -m experiments.presets 8b /tmp/m/8b
if [ "${CHECKQ4:-1}" = 1 ]; then
  stage check-q4
  MLXP_MEGA_PROF=1 run $(lim 5 90) python3 experiments/mega_check.py \
    --model /tmp/m/1b-q4 --steps 16 --out "$OUT/mega_check_q4.json"
fi
if [ "${BENCHQ4:-1}" = 1 ]; then
  stage bench-q4
  run $(lim 5 170) python3 experiments/bench_decode.py --model /tmp/m/1b-q4 --tier l1,l3 \
    --lengths 128,2048 --gen 64 --trials 5 --tag h200-q4-mega --out "$OUT/bench-q4"
fi
if [ "${TRAINED:-0}" = 1 ]; then
  stage trained-gate
  run $(lim 5 ${TRAINED_S:-300}) python3 experiments/trained_gate.py --preset 1b --steps ${TRAINED_STEPS:-500} \
    --gate-batch 8 --bits 4 --out /tmp/trained
  mkdir -p "$OUT/trained" && cp -r /tmp/trained/gate* /tmp/trained/train.json "$OUT/trained/" 2>/dev/null
fi
if [ "${CHECK1B:-1}" = 1 ]; then
  stage check-bf16
  MLXP_MEGA_PROF=1 run $(lim 5 60) python3 experiments/mega_check.py --model /tmp/m/1b --steps 16 \
    --out "$OUT/mega_check_1b.json"
fi
if [ "${BENCH1B:-1}" = 1 ]; then
  stage bench-1b
  run $(lim 5 90) python3 experiments/bench_decode.py --model /tmp/m/1b --tier l1,l3 \
    --lengths 128,2048 --gen 64 --trials 5 --tag h200-mega --out "$OUT/bench"
fi
if [ "${E8B:-1}" = 1 ]; then
  stage 8b
  run $(lim 5 150) python3 experiments/bench_decode.py --model /tmp/m/8b --tier l1,l3 \
    --lengths 128,2048 --gen 64 --trials 5 --tag h200-8b-mega --out "$OUT/bench-8b"
  MLXP_MEGA_PROF=1 run $(lim 5 60) python3 experiments/mega_check.py --model /tmp/m/8b --steps 8 \
    --out "$OUT/mega_check_8b.json"
  run $(lim 5 70) python3 experiments/l3_overhead.py --model /tmp/m/8b --modes l1,l3 --trials 3 \
    --out "$OUT/overhead_8b.jsonl"
fi
if [ "${Q8:-0}" = 1 ]; then
  stage q8
  python3 -m experiments.presets 1b /tmp/m/1b-q8 --bits 8
  MLXP_MEGA_PROF=1 run $(lim 5 90) python3 experiments/mega_check.py \
    --model /tmp/m/1b-q8 --steps 16 --out "$OUT/mega_check_q8.json"
  [ "${Q8BENCH:-1}" = 1 ] && run $(lim 5 120) python3 experiments/bench_decode.py \
    --model /tmp/m/1b-q8 --tier l1,l3 --lengths 128,2048 --gen 64 --trials 5 --tag h200-q8-mega --out "$OUT/bench-q8"
fi
if [ "${QWEN3:-0}" = 1 ]; then
  stage qwen3
  python3 -m experiments.presets qwen3-2b /tmp/m/qwen3-2b
  MLXP_MEGA_PROF=1 run $(lim 5 90) python3 experiments/mega_check.py \
    --model /tmp/m/qwen3-2b --steps 16 --out "$OUT/mega_check_qwen3.json"
  run $(lim 5 120) python3 experiments/bench_decode.py --model /tmp/m/qwen3-2b \
    --tier l1,l3 --lengths 128,2048 --gen 64 --trials 5 --tag h200-qwen3-mega --out "$OUT/bench-qwen3"
fi
if [ "${BATCH:-1}" = 1 ]; then
  stage batch
  run $(lim 5 120) python3 experiments/merged_exactness.py --model /tmp/m/1b --specs l3 \
    --batches 8,32 --trials 3 --out "$OUT/batch.jsonl"
  MLXP_DISABLE_KERNELS=gemv run $(lim 3 60) python3 experiments/merged_exactness.py --model /tmp/m/1b \
    --specs l3,l1+merged_proj --batches 32 --trials 3 --out "$OUT/batch32_nogemv.jsonl"
fi
if [ "${PROFB:-0}" = 1 ]; then
  stage batch-profile
  run $(lim 3 120) python3 experiments/batch_profile.py --model /tmp/m/1b --batches 8,32 --out "$OUT/batch_profile.json"
fi
stage done
} 2>&1 | tee "$OUT/qp.log"
