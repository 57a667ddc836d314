#!/bin/bash
# The L3 device run in one go (kernel checks, exactness, gate, benchmarks), results under $OUT.
#   bash experiments/l3_h200.sh        (from the repo root, MLX's CUDA build on PYTHONPATH)
# Envs: BUDGET (s), TIERS, GEN, GATE_PROMPTS, GATE_BATCH (rows of the batch gate, 0: none), FULL=1 (4-bit and 8B too: FULL_MODELS, FULL_LENGTHS, FULL_GEN), AB_GEMV=1 (L3 once
# more with the fused GEMV off), BATCH=1 (the batch lane at 8 and 32 rows vs BatchGenerator),
# EXACT=0 (skip the exactness stage), OVERHEAD=0 (skip experiments/l3_overhead.py),
# TRAINED=1 (the gate on a 1b model trained on a synthetic language: TRAINED_PRESET, TRAINED_STEPS), KCHECK_ARGS (e.g. "--gemv-budgets 8,16"), KCHECK_S.
# Each stage has its own time limit; a failing kernel check switches that kernel off
# ($MLXP_DISABLE_KERNELS) for the later stages rather than stopping the run.
set -u
export PYTHONUNBUFFERED=1 MLXP_FIXTURE_DIR=/tmp/fix HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/l3out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-150}; T0=$(date +%s)
PRESET=${PRESET:-1b}; M=/tmp/m/$PRESET   # PRESET=speed: a small model, for a dry run on the CPU
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
lim() { local v=$(( $(left) - $1 )); [ "$v" -lt 1 ] && v=1; echo "$v"; }
stage() { echo "### $1 (t=$(( $(date +%s) - T0 ))s, left $(left)s)"; }
{
stage env
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,memory.used --format=csv,noheader
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.cuda.is_available())"
stage build-1b
python3 -m experiments.presets "$PRESET" "$M"
stage kernel-check
timeout ${KCHECK_S:-150} python3 experiments/l3_kernel_check.py --reps 10 ${KCHECK_ARGS:-} --out "$OUT/kernel_check.json"
# switched off: the kernels that failed, and those the check did not reach before its limit
FAILED=$(python3 -c "
import json; s = json.load(open('$OUT/kernel_check.json'))['summary']
print(','.join(sorted(set(s['failed']) | ({'add_rms', 'rope_qkv', 'attention', 'gemv'} - set(s.get('checked', []))))))
" 2>/dev/null || echo add_rms,rope_qkv,attention,gemv)
export MLXP_DISABLE_KERNELS=${FAILED}
echo "MLXP_DISABLE_KERNELS=$MLXP_DISABLE_KERNELS"
if [ "${OVERHEAD:-1}" = 1 ]; then
  stage overhead
  timeout $(lim 30) python3 experiments/l3_overhead.py --model "$M" --out "$OUT/overhead.jsonl"
fi
stage bench-1b
timeout $(lim 30) python3 experiments/bench_decode.py --model "$M" \
  --tier ${TIERS:-l1,l3,l3-compiled_decode,l3-perf_kernel-fused_sdpa,l1+merged_proj} \
  --lengths 128,2048 --gen ${GEN:-64} --trials 5 --tag h200-1b --out "$OUT/bench"
if [ "${AB_GEMV:-0}" = 1 ]; then
  stage bench-1b-without-gemv
  MLXP_DISABLE_KERNELS=${MLXP_DISABLE_KERNELS:+$MLXP_DISABLE_KERNELS,}gemv timeout $(lim 30) \
    python3 experiments/bench_decode.py --model "$M" --tier l3 --lengths 128,2048 \
    --gen ${GEN:-64} --trials 5 --tag h200-1b-without-gemv --out "$OUT/bench-nogemv"
fi
if [ "${BATCH:-0}" = 1 ]; then
  stage batch
  timeout $(lim 3) python3 experiments/merged_exactness.py --model "$M" \
    --specs ${BATCH_SPECS:-l1+merged_proj,l3} --batches 8,32 --trials ${BATCH_TRIALS:-3} \
    --out "$OUT/batch.jsonl"
fi
if [ "${FULL:-0}" = 1 ]; then
  stage bench-q4-8b
  FULL_MODELS=${FULL_MODELS:-1b-q4,8b}; MARGS=""
  for m in ${FULL_MODELS//,/ }; do
    case $m in 1b-q4) python3 -m experiments.presets 1b /tmp/m/1b-q4 --bits 4;;
               *) python3 -m experiments.presets "$m" "/tmp/m/$m";; esac
    MARGS="$MARGS --model /tmp/m/$m"
  done
  timeout $(lim 5) python3 experiments/bench_decode.py $MARGS \
    --tier l1,l3 --lengths ${FULL_LENGTHS:-128,2048} --gen ${FULL_GEN:-128} --trials 5 --tag h200-q4-8b --out /tmp/bench2
  cp /tmp/bench2/bench_decode.csv "$OUT/bench2.csv" 2>/dev/null
fi
stage gate
timeout $(lim 3) python3 -m parity.l3_gate --model "$M" --prompts ${GATE_PROMPTS:-8} --batch ${GATE_BATCH:-8} \
  --tag h200-1b --out "$OUT/gate"
if [ "${TRAINED:-0}" = 1 ]; then
  stage trained-gate
  timeout $(lim 2) python3 experiments/trained_gate.py --preset ${TRAINED_PRESET:-1b} \
    --steps ${TRAINED_STEPS:-500} --gate-batch ${GATE_BATCH:-8} --out /tmp/trained
  mkdir -p "$OUT/trained" && cp -r /tmp/trained/gate /tmp/trained/train.json "$OUT/trained/" 2>/dev/null
fi
if [ "${EXACT:-1}" = 1 ]; then
stage exactness
timeout $(lim 2) python3 experiments/l3_exactness.py --model "$M" --steps 8
fi
stage done
} 2>&1 | tee "$OUT/l3_h200.log"
