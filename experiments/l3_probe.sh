#!/bin/bash
# Where the L3 step's time goes, on the device (results under $OUT):
#   1. experiments/gemv_sweep.py: every GEMV layout against MLX's matmul, per projection shape;
#   2. experiments/l3_overhead.py: the step with its kernels emptied (launch-bound or not),
#      with the warp and the split GEMV layouts, and with MLX's CUDA graphs holding a whole
#      step (MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER) against its defaults;
#   3. the 1b bench (l1, l3) and a short gate, if time is left.
#   OUT=/tmp/probe BUDGET=480 bash experiments/l3_probe.sh
set -u
OUT=${OUT:-/tmp/probe}
BUDGET=${BUDGET:-480}
source "$(dirname "$0")/stages.sh"
M=/tmp/m/1b
{
stage env
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,memory.used --format=csv,noheader
for t in ncu nsys; do command -v $t || ls /usr/local/cuda*/bin/$t /opt/nvidia/*/$t 2>/dev/null; done
stage build-1b
python3 -m experiments.presets 1b "$M"
stage sweep-b1
timeout $(lim 360 ${SWEEP_S:-150}) python3 experiments/gemv_sweep.py --batches 1 --out "$OUT/sweep_b1.jsonl" | tail -1
stage overhead-warp
timeout $(lim 240 60) python3 experiments/l3_overhead.py --model "$M" --modes l1,l3,l3-empty --trials 3 \
  --out "$OUT/overhead_warp.jsonl"
stage overhead-one-graph
MLX_MAX_OPS_PER_BUFFER=1000 MLX_MAX_MB_PER_BUFFER=100000 timeout $(lim 160 45) python3 experiments/l3_overhead.py \
  --model "$M" --modes l1,l3,l3-empty --trials 3 --out "$OUT/overhead_onegraph.jsonl"
stage overhead-2048
timeout $(lim 120 50) python3 experiments/l3_overhead.py --model "$M" --prompt 2048 --modes l1,l3,l3-empty \
  --trials 3 --out "$OUT/overhead_2048.jsonl"
stage sweep-b8
timeout $(lim 60 90) python3 experiments/gemv_sweep.py --batches 8 --quick --out "$OUT/sweep_b8.jsonl" | tail -1
stage kernel-check
timeout $(lim 10 60) python3 experiments/l3_kernel_check.py --reps 10 --out "$OUT/kernel_check.json" | tail -1
stage done
} 2>&1 | tee "$OUT/probe.log"
