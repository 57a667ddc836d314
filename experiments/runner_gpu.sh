#!/bin/bash
# The fast runner's GPU run (issue "One step for every row"), results under $OUT.
#   bash experiments/runner_gpu.sh    (repo root, MLX's CUDA build on PYTHONPATH)
# STAGES: a comma list of gate (trained 1b, L3 gate solo + rows joining/leaving at GATE_BATCH,
# 4-bit too), inproc (Engine API decode at 1/8/32 rows, l1 vs l3, vs mlx-lm), served (HTTP:
# engine-serve vs mlx_lm.server at LEVELS clients, SERVED_ARGS), served8b (8B 4-bit, l3),
# serveddet (the same as servedl1 with --deterministic: its served cost, beside servedl1 in one run),
# servedl1 (the default engine-serve, --batch L1_BATCH (32, the default), L1, vs mlx_lm.server), served8bf (8B bf16, l3,
# one client: the weight-read roofline target), qmm (experiments/qmm_probe.py: the 4-bit
# tensor-core projections against MLX's quantized matmul), rows8b (8B 4-bit in-process at ROWS8 rows, l1
# vs l3), check8b (CHECK8_MODEL 8b-q4 or 8b (bf16), one row: the one kernel against the step of separate kernels and
# L1; the kernel's phase times), join8b (8B 4-bit: each Engine step's time while 16 rows join),
# agent (experiments/agent_session.py on AGENT_MODELS, phases AGENT_PHASES, vs mlx_lm.server unless AGENT_NO_MLXLM=1).
# restore (experiments/disk_restore_cost.py: a ~25K-token disk prompt cache restore, 1B and 8B KV shapes, part by part).
# sprof (experiments/served_profile.py: a lone served stream on SPROF_MODEL, two server variants, client vs engine
#   clock, py-spy's top frames per thread).
# restartab (agent_session's restart phase on RAB_MODELS with the warm-up's long prompt + restore rehearsal on and off
#   (--warm-up-tokens 0), one cold phase each, RAB_TURNS turns; every turn's server-side phases in the CSV).
# lone (experiments/lone_row.py: a lone request on --batch 32 vs --batch 1, 1B: speed and
# equal tokens/logprobs), q4one (Q4ONE_PRESET, default 8b, 4-bit at 1 and 2 rows on the fast runner
# as routed and with MLXP_DISABLE_KERNELS=mega: which step a 4-bit row should take; Q4ONE_PRESET=1b
# checks the one-row bound of engine/fast/decode.py:one_kernel_rows from below).
# q4mma (the one kernel's 4-bit dot on 8B and 1B 4-bit: mega_check against L1 and the separate
# kernels, 8B forced onto it; bench_rows at Q4MMA_ROWS rows as routed and forced onto the one kernel).
# spec (experiments/spec_bench.py: a trained 1b target and draft served plain, --draft-model and
# --prompt-lookup at SPEC_LEVELS clients, K SPEC_K (lookup: SPEC_LOOKUP_K, a comma list: a server each), through HTTP;
# SPEC_DRAFT_MAX_ROWS: the draft servers' --draft-max-rows; SPEC_INFLATE=8b: the trained target padded into the 8B shape, spec and rounds;
# SPEC_OURS_ARGS: every server's extra arguments, e.g. '--tier l3': speculation on the fast runner; SPEC_SEQUENTIAL=1: one server at a time;
# SPEC_TRIALS: trials a level (3; each trial's prompts differ, and so does their acceptance)).
# ab (two trees head to head in one call: this one and AB_DIR, a copy of another commit's engine/,
#   experiments/, parity/ and train/ (AB_SPEC's training needs the last two) carried beside it, made before the call with
#   `mkdir abref_x && git archive REF engine experiments parity train | tar -x -C abref_x`: bench_rows --tiers l3 on AB_MODELS (8b, 8b-q4, 1b, 1b-q4) at
#   AB_ROWS rows from each tree in turn, AB_ROUNDS times, AB_ARGS added (e.g. --one-kernel-4bit); AB_VERIFY=1: then
#   experiments/fast_verify_gpu.py in each tree in turn (the verify step's cost and exactness, K of FV_KS); AB_SPEC=1:
#   experiments/spec_rounds.py in each tree in turn (rounds' settings: SPEC_INFLATE, ROUNDS_TIER (l3), ROUNDS_MODES (fastdraft));
#   AB_CHECK=1: then mega_check with the phase timer in each (logits against L1, phases)).
# fverify (experiments/fast_verify_gpu.py on FV_MODELS, default 1b 8b-q4: the fast runner's verify step against single
#   fast steps, bit-equal / argmax, and its cost against a plain step, FV_ROWS rows, K of FV_KS; FV_PROF=1: the
#   one kernel with its phase timer, each phase's time of the plain step and of the verify).
# vexact (experiments/verify_exactness_gpu.py on 1b and a one-layer 1b: a row's two tokens as single steps, one verify,
#   a two-row pool, two verifies: where a verify's later positions part from single steps).
# stalls (experiments/spec_stalls.py on spec's trained pair: staggered speculating rows, K STALLS_K, a stack for each slow step).
# rounds (experiments/spec_rounds.py on spec's trained pair: a speculation round's parts, in process, at ROUNDS_ROWS rows;
#   ROUNDS_TIER=l3: the target on the fast runner; ROUNDS_MODES: which of lookup,draft,fastdraft).
# phases (experiments/ttft_phases.py on PHASE_MODELS: where a cached agent turn's first token goes, PHASE_ARGS, PHASE_PROFILE,
#   once per PHASE_VARIANTS entry: - or an env assignment such as MLXP_BUCKETED_SDPA=1).
# det (experiments/deterministic_gpu.py: the batch-invariant kernels op by op, the needle on 1b bf16 and 4-bit, controls, cost).
# detops (experiments/det_ops_probe.py: deterministic mode's ops one by one against the stock ones).
# sdpa (experiments/sdpa_plan_probe.py: a new K/V length's cost to a multi-token query, exact vs padded+masked vs composed).
# GATE_QUANT_ONLY=1 gates only the quantized model (GATE_BITS) at GATE_BATCH rows; GATE_VERIFY=1,8: the fast
# runner's verify steps too (speculating rows, K 4, some drafts taken back), at those row counts.
set -u
export PYTHONUNBUFFERED=1 MLXP_FIXTURE_DIR=/tmp/fix HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/runner}; mkdir -p "$OUT"; T0=$(date +%s)
STAGES=${STAGES:-gate,served}
stage() { echo "### $1 (t=$(( $(date +%s) - T0 ))s)"; }
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stage env
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
# engine-serve's runtime dependencies the device image lacks must travel in .dev2/extra
# (`bash experiments/device_prep.sh` makes .dev1/.dev2 with them): a missing one failed a whole
# stage with a 500 on its first request
python3 -c "import jsonschema, llguidance, prometheus_client, fastapi, uvicorn, pydantic" \
  || { echo "engine-serve's dependencies are missing on this machine (see above)"; exit 2; }
[ -d /tmp/m/1b ] || python3 -m experiments.presets 1b /tmp/m/1b
if has gate; then
  stage gate
  # (GATE_S: the stage's limit; with GATE_VERIFY 480 s by default: 300 s ended a run before its 4-bit model)
  timeout ${GATE_S:-$([ -n "${GATE_VERIFY:-}" ] && echo 480 || echo 300)} python3 experiments/trained_gate.py --preset 1b --steps ${GATE_STEPS:-500} \
    --gate-batch ${GATE_BATCH:-8,32} ${GATE_VERIFY:+--gate-verify $GATE_VERIFY} --bits ${GATE_BITS:-4} ${GATE_QUANT_ONLY:+--quant-only} --out "$OUT/gate" 2>&1 | grep -v '"step"' | tail -40
fi
if has inproc; then
  stage inproc
  timeout ${INPROC_S:-200} python3 experiments/bench_rows.py --model /tmp/m/1b --rows ${ROWS:-1,8,32} \
    --out "$OUT/inproc" 2>&1 | tail -20
fi
if has served; then
  stage served
  timeout ${SERVED_S:-300} python3 experiments/bench_batching.py --model /tmp/m/1b --levels ${LEVELS:-1,8,32} \
    --gen ${GEN:-128} --trials ${TRIALS:-1} --ours-args "${SERVED_ARGS:---tier l3}" --tag ${TAG:-h100-1b-l3} \
    --out "$OUT/served" 2>&1 | tail -20
fi
if has served8b; then
  stage served8b
  [ -d /tmp/m/8b-q4 ] || python3 -m experiments.presets 8b /tmp/m/8b-q4 --bits 4
  timeout ${SERVED8_S:-300} python3 experiments/bench_batching.py --model /tmp/m/8b-q4 --levels ${LEVELS8:-1,16} \
    --gen ${GEN:-128} --trials ${TRIALS:-1} --ours-args "${SERVED_ARGS:---tier l3}" --tag ${TAG8:-h100-8b-q4-l3} \
    --out "$OUT/served8b" 2>&1 | tail -20
fi
if has servedl1; then
  stage servedl1
  timeout ${SERVEDL1_S:-200} python3 experiments/bench_batching.py --model /tmp/m/1b --levels ${LEVELS:-1,8,32} \
    --gen ${GEN:-128} --trials ${TRIALS:-1} --ours-batch ${L1_BATCH:-32} --tag ${TAGL1:-h100-1b-l1-default} \
    --out "$OUT/servedl1" 2>&1 | tail -20
fi
if has serveddet; then
  stage serveddet
  timeout ${SERVEDDET_S:-300} python3 experiments/bench_batching.py --model /tmp/m/1b --levels ${LEVELS:-1,8,32} \
    --gen ${GEN:-128} --trials ${TRIALS:-1} --ours-batch ${L1_BATCH:-32} --ours-args=--deterministic \
    --tag ${TAGDET:-h100-1b-deterministic} --out "$OUT/serveddet" 2>&1 | tail -20
fi
if has served8bf; then
  stage served8bf
  [ -d /tmp/m/8b ] || python3 -m experiments.presets 8b /tmp/m/8b
  timeout ${SERVED8F_S:-240} python3 experiments/bench_batching.py --model /tmp/m/8b --levels 1 \
    --gen ${GEN:-128} --trials ${TRIALS:-1} --ours-args "--tier l3" --tag ${TAG8F:-h100-8b-l3} \
    --out "$OUT/served8bf" 2>&1 | tail -20
fi
if has qmm; then
  stage qmm
  timeout ${QMM_S:-300} python3 experiments/qmm_probe.py --out "$OUT/qmm" --rows ${QMM_ROWS:-1,8,16,32} \
    --trials ${QMM_TRIALS:-3} --configs "${QMM_CONFIGS:-}" 2>&1 | tail -60
fi
if has check8b; then
  stage check8b
  C8=${CHECK8_MODEL:-8b-q4}
  [ -d /tmp/m/$C8 ] || python3 -m experiments.presets 8b /tmp/m/$C8 $([ "$C8" = 8b-q4 ] && echo --bits 4)
  MLXP_MEGA_PROF=1 timeout ${CHECK8_S:-200} python3 experiments/mega_check.py --model /tmp/m/$C8 --steps 16 \
    --out "$OUT/check8b.json" 2>&1 | tail -30
fi
if has rows8b; then
  stage rows8b
  [ -d /tmp/m/8b-q4 ] || python3 -m experiments.presets 8b /tmp/m/8b-q4 --bits 4
  timeout ${ROWS8_S:-300} python3 experiments/bench_rows.py --model /tmp/m/8b-q4 --rows ${ROWS8:-1,4,8,16,32} \
    --gen ${GEN8:-64} --trials ${TRIALS:-1} --out "$OUT/rows8b" 2>&1 | tail -20
fi
if has join8b; then
  stage join8b
  [ -d /tmp/m/8b-q4 ] || python3 -m experiments.presets 8b /tmp/m/8b-q4 --bits 4
  timeout ${STALL_S:-200} python3 experiments/stall_probe.py --model /tmp/m/8b-q4 --clients 16 --gen 128 2>&1 | tail -c 6000
  for tier in ${JOIN_TIERS:-l3 l1}; do
    timeout ${JOIN_S:-150} python3 experiments/join_timeline.py --model /tmp/m/8b-q4 --tier $tier --rows 16 \
      --gen ${JOIN_GEN:-24} 2>&1 | tail -${JOIN_TAIL:-60}
  done
fi
if has lone; then
  stage lone
  timeout ${LONE_S:-150} python3 experiments/lone_row.py --model /tmp/m/1b --batch 32 --gen 256 2>&1 | tail -5
fi
if has q4mma; then
  # the one kernel's 4-bit dot: its logits against L1 and the separate kernels (8B forced onto
  # the one kernel, 1B as routed), its phases; one row's speed on each route
  stage q4mma
  for P in 8b 1b; do [ -d /tmp/m/$P-q4 ] || python3 -m experiments.presets $P /tmp/m/$P-q4 --bits 4; done
  MLXP_MEGA_PROF=1 timeout ${CHECK8_S:-200} python3 experiments/mega_check.py --model /tmp/m/8b-q4 --steps 16 \
    --one-kernel-4bit --out "$OUT/check8b-q4.json" 2>&1 | tail -40
  MLXP_MEGA_PROF=1 timeout 120 python3 experiments/mega_check.py --model /tmp/m/1b-q4 --steps 16 \
    --out "$OUT/check1b-q4.json" 2>&1 | grep -A4 '"mega"' | head -12
  q4rows() {   # preset, tag, extra bench_rows arguments (env assignments before it apply)
    echo "$1-q4 $2"
    timeout ${Q4ONE_S:-120} python3 experiments/bench_rows.py --model /tmp/m/$1-q4 --rows ${Q4MMA_ROWS:-1} --tiers l3 \
      --gen 64 --trials 3 "${@:3}" --out "$OUT/q4mma-$1-$2" 2>&1 | tail -${Q4MMA_TAIL:-2}
  }
  q4rows 8b routed; q4rows 8b forced --one-kernel-4bit
  q4rows 1b routed; MLXP_DISABLE_KERNELS=mega q4rows 1b no-mega
fi
if has q4one; then
  stage q4one
  P=${Q4ONE_PRESET:-8b}
  [ -d /tmp/m/$P-q4 ] || python3 -m experiments.presets $P /tmp/m/$P-q4 --bits 4
  for off in "" mega; do
    echo "MLXP_DISABLE_KERNELS=$off"
    MLXP_DISABLE_KERNELS=$off timeout ${Q4ONE_S:-120} python3 experiments/bench_rows.py --model /tmp/m/$P-q4 \
      --rows 1,2 --tiers l3 --gen 64 --trials 3 --out "$OUT/q4one-${off:-default}" 2>&1 | tail -4
  done
fi
if has spec; then
  stage spec
  timeout ${SPEC_S:-540} python3 experiments/spec_bench.py --target 1b --steps ${SPEC_STEPS:-500} \
    --levels ${SPEC_LEVELS:-1,8} --gen ${GEN:-128} --trials ${SPEC_TRIALS:-3} --k ${SPEC_K:-4} --draft-layers ${SPEC_DRAFT_LAYERS:-4} --modes ${SPEC_MODES:-draft,lookup} \
    ${SPEC_LOOKUP_K:+--lookup-k $SPEC_LOOKUP_K} ${SPEC_DRAFT_MAX_ROWS:+--draft-max-rows $SPEC_DRAFT_MAX_ROWS} ${SPEC_INFLATE:+--inflate $SPEC_INFLATE} \
    --ours-args "${SPEC_OURS_ARGS:-}" ${SPEC_SEQUENTIAL:+--sequential} --tag h100 --work /tmp/specwork --out "$OUT/spec${SPEC_DRAFT_LAYERS:-}" 2>&1 | grep -v '"step"' | tail -12
fi
if has rounds; then
  stage rounds
  timeout ${ROUNDS_S:-300} python3 experiments/spec_rounds.py --work /tmp/specwork --k ${SPEC_K:-4} --rows ${ROUNDS_ROWS:-1} --draft-layers ${SPEC_DRAFT_LAYERS:-4} ${SPEC_INFLATE:+--inflate $SPEC_INFLATE} \
    --tier ${ROUNDS_TIER:-l1} --modes ${ROUNDS_MODES:-lookup,draft,fastdraft} \
    --gen ${GEN:-128} --tag h100 --out "$OUT/rounds" 2>&1 | grep -v '"step"' | tail -8
fi
if has ab; then
  stage ab
  for P in ${AB_MODELS:-8b}; do
    [ -d /tmp/m/$P ] || python3 -m experiments.presets ${P%-q4} /tmp/m/$P $([[ $P == *-q4 ]] && echo --bits 4) >/dev/null
  done
  for r in $(seq ${AB_ROUNDS:-2}); do for tag in this ref; do for P in ${AB_MODELS:-8b}; do
    tree=.; [ $tag = ref ] && tree=${AB_DIR:?AB_DIR: the other tree}
    echo "$r $tag $P $(cd $tree && timeout ${AB_S:-150} python3 experiments/bench_rows.py --model /tmp/m/$P \
      --rows ${AB_ROWS:-1} --tiers l3 --gen 128 --trials 3 ${AB_ARGS:-} --out "$OUT/ab-$tag-$P-$r" 2>&1 | tail -1)"
  done; done; done
  if [ -n "${AB_VERIFY:-}" ]; then for r in $(seq ${AB_ROUNDS:-2}); do for tag in this ref; do
    tree=.; [ $tag = ref ] && tree=$AB_DIR
    echo "verify $r $tag"; (cd $tree && timeout ${AB_S:-150} python3 experiments/fast_verify_gpu.py \
      $(for P in ${AB_MODELS:-8b}; do echo --model /tmp/m/$P; done) --rows ${AB_ROWS:-1} --ks ${FV_KS:-2,4,8} 2>&1 | grep '"model"')
  done; done; fi
  if [ -n "${AB_SPEC:-}" ]; then for r in $(seq ${AB_ROUNDS:-2}); do for tag in this ref; do
    tree=.; [ $tag = ref ] && tree=$AB_DIR
    echo "spec $r $tag"; (cd $tree && timeout ${AB_S:-150} python3 experiments/spec_rounds.py --work /tmp/specwork --k ${SPEC_K:-4} \
      --rows ${ROUNDS_ROWS:-1} ${SPEC_INFLATE:+--inflate $SPEC_INFLATE} --tier ${ROUNDS_TIER:-l3} --modes ${ROUNDS_MODES:-fastdraft} \
      --gen ${GEN:-128} --out "$OUT/abspec-$tag-$r" 2>&1 | grep '"mode"')
  done; done; fi
  if [ -n "${AB_CHECK:-}" ]; then for tag in this ref; do for P in ${AB_MODELS:-8b}; do
    tree=.; [ $tag = ref ] && tree=$AB_DIR
    echo "check $tag $P"; (cd $tree && MLXP_MEGA_PROF=1 timeout 200 python3 experiments/mega_check.py --model /tmp/m/$P \
      --steps 16 ${AB_ARGS:-} --out "$OUT/abcheck-$tag-$P.json" 2>&1 | grep -E 'mean_kl_vs_l1|top1_vs_l1|"(qkv_rope|attention|o_proj|gate_up|down|head|total)": [0-9]' | head -16)
  done; done; fi
fi
if has fverify; then
  stage fverify
  for P in ${FV_MODELS:-1b 8b-q4}; do
    [ -d /tmp/m/$P ] || python3 -m experiments.presets ${P%-q4} /tmp/m/$P $([[ $P == *-q4 ]] && echo --bits 4) >/dev/null
  done
  MLXP_MEGA_PROF=${FV_PROF:-0} timeout ${FV_S:-300} python3 experiments/fast_verify_gpu.py $(for P in ${FV_MODELS:-1b 8b-q4}; do echo --model /tmp/m/$P; done) \
    --rows ${FV_ROWS:-1,8} --ks ${FV_KS:-2,4,8} --out "$OUT/fverify" 2>&1 | tail -24
fi
if has vexact; then
  stage vexact
  [ -d /tmp/m/1b-l1 ] || python3 -m experiments.presets 1b /tmp/m/1b-l1 --layers 1 >/dev/null
  timeout ${VEXACT_S:-200} python3 experiments/verify_exactness_gpu.py --model /tmp/m/1b --model /tmp/m/1b-l1 \
    --out "$OUT/verify_exactness.json" 2>&1 | tail -8
fi
if has stalls; then
  stage stalls
  timeout ${STALLS_S:-420} python3 experiments/spec_stalls.py --work /tmp/specwork --k ${STALLS_K:-4,8} --rows ${STALLS_ROWS:-8} \
    --gap ${STALLS_GAP:-3} --tag h100 --out "$OUT/stalls" 2>&1 | grep -v '"step": [0-9]*, "loss"' | tail -${STALLS_TAIL:-70}
fi
if has agent; then
  for m in ${AGENT_MODELS:-8b-q4 1b}; do
    stage "agent $m"
    case $m in 8b-q4) [ -d /tmp/m/8b-q4 ] || python3 -m experiments.presets 8b /tmp/m/8b-q4 --bits 4;; esac
    timeout ${AGENT_S:-240} python3 experiments/agent_session.py --model /tmp/m/$m $([ -n "${AGENT_NO_MLXLM:-}" ] || echo --mlx-lm) \
      --prefix-tokens ${AGENT_PREFIX:-16000} --turns ${AGENT_TURNS:-10} --phases ${AGENT_PHASES:-default,l3} \
      --tag h100-$m 2>&1 | tail -${AGENT_TAIL:-30}
    mkdir -p "$OUT/agent"; cp -r reports/prompt_cache_disk/*/h100-$m "$OUT/agent/" 2>/dev/null
  done
fi
if has restartab; then
  # a restarted server's turn with the warm-up's long prompt and restore rehearsal
  # (--warm-up-tokens 0: neither) against without, each model: one cold phase, then both
  # restart phases, every turn's server-side phases (queue, lookup incl. the restore, prefill)
  for m in ${RAB_MODELS:-1b 8b-q4}; do
    stage "restartab $m"
    case $m in 8b-q4) [ -d /tmp/m/8b-q4 ] || python3 -m experiments.presets 8b /tmp/m/8b-q4 --bits 4;; esac
    for v in "off:cold,restart" "on:restart"; do
      a=${v%%:*}; p=${v#*:}
      # (an 8B 4-bit cold phase + restart phase took more than 170 s on an H100: the files of a
      # run ended by the timeout are lost)
      timeout ${RAB_S:-$([ $m = 1b ] && echo 170 || echo 320)} python3 experiments/agent_session.py --model /tmp/m/$m --prefix-tokens ${AGENT_PREFIX:-24000} \
        --turns ${RAB_TURNS:-3} --phases $p --server-args "$([ $a = off ] && echo --warm-up-tokens 0)" \
        --tag h100-$m-warm-$a --out "$OUT/restartab/$m-$a" 2>&1 | grep -E "'phase': '(cold|restart)'|'warm_up'"
    done
  done
fi
if has sprof; then
  # a lone served stream, engine's clock against the client's, py-spy on the server (its wheel in
  # .dev2/extra: its binary lands in /tmp/site/bin), SPROF_MODEL (8b-q4) on SPROF_VARIANTS
  m=${SPROF_MODEL:-8b-q4}
  stage "sprof $m"
  case $m in 8b-q4) [ -d /tmp/m/8b-q4 ] || python3 -m experiments.presets 8b /tmp/m/8b-q4 --bits 4;; esac
  PATH=$PATH:/tmp/site/bin timeout ${SPROF_S:-300} python3 experiments/served_profile.py --model /tmp/m/$m \
    --gen ${SPROF_GEN:-256} --variants "${SPROF_A:---tier l3 --batch 1}" "${SPROF_B:---tier l3 --batch 16}" \
    --out "$OUT/sprof-$m" 2>&1 | grep '"variant"'
fi
if has restore; then
  stage restore       # (a disk prompt cache restore part by part, 1B and 8B KV shapes, ~25K tokens)
  timeout ${RESTORE_S:-120} python3 experiments/disk_restore_cost.py --tag h100-1b 2>&1 | grep "'tag'"
  timeout ${RESTORE_S:-120} python3 experiments/disk_restore_cost.py --layers 32 --head-dim 128 --trials 2 \
    --tag h100-8b 2>&1 | grep "'tag'"
  mkdir -p "$OUT/restore"; cp -r reports/disk_restore/*/h100-* "$OUT/restore/" 2>/dev/null
fi
if has det; then
  stage det
  [ -d /tmp/m/1b-q4 ] || python3 -m experiments.presets 1b /tmp/m/1b-q4 --bits 4
  timeout ${DET_S:-300} python3 experiments/deterministic_gpu.py --model /tmp/m/1b --quant-model /tmp/m/1b-q4 \
    --out "$OUT/det" ${DET_ARGS:-} 2>&1 | tail -${DET_TAIL:-12}
fi
if has detops; then
  stage detops
  timeout 200 python3 experiments/det_ops_probe.py --rows ${DETOPS_ROWS:-1,8,32} --out "$OUT/det_ops.json" 2>&1 | tail -5
fi
if has sdpa; then
  stage sdpa
  timeout 120 python3 experiments/sdpa_plan_probe.py --out "$OUT/sdpa-q400.json" 2>&1 | tail -3
  timeout 120 python3 experiments/sdpa_plan_probe.py --q 5 --start 300 --step 5 --turns 12 --bucket 256 \
    --out "$OUT/sdpa-q5.json" 2>&1 | tail -2
fi
if has phases; then
  for m in ${PHASE_MODELS:-1b 8b-q4}; do
    stage "phases $m"
    case $m in 8b-q4) [ -d /tmp/m/8b-q4 ] || python3 -m experiments.presets 8b /tmp/m/8b-q4 --bits 4;; esac
    for var in ${PHASE_VARIANTS:--}; do        # "-": as is; else an env assignment (A=1)
      echo "variant $var"
      env $([ "$var" = - ] || echo "$var") timeout ${PHASES_S:-200} python3 experiments/ttft_phases.py \
        --model /tmp/m/$m --prefix-tokens ${AGENT_PREFIX:-16000} --turns ${PHASE_TURNS:-6} --server-args "${PHASE_ARGS:-}" \
        --out "$OUT/phases-$m-${var//=/_}.md" --csv "$OUT/phases-$m-${var//=/_}.csv" \
        ${PHASE_PROFILE:+--profile $PHASE_PROFILE} 2>&1 | tail -${PHASE_TAIL:-24}
    done
  done
fi
# every small result (under 2 MB) packed into one file that sorts first: the device tool returns
# at most 8 files, and runs of several stages write more
(cd "$OUT" && find . -type f -size -2M ! -name 00-results.tgz | sort | tar czf 00-results.tgz -T - 2>/dev/null)
stage done
