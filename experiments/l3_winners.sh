#!/bin/bash
# Device run, after experiments/l3_sweep.sh built the presets under /tmp/m and wrote
# $SW/sweep_8b.json (its VARIANTS8 naming 596 and 596:prod=KB variants): the 8b step's
# per-block arrivals (experiments/mega_blocks.py, the calibration MLXP_MEGA_BAL reads), the
# one-kernel step with that plan against the default and DYN (experiments/mega_sweep.py), then
# a same-run bench against mlx-lm (experiments/bench_decode.py, 5 trials) of each choice whose
# profiled step at prompt 128 was at least 1% shorter than the default's: the best producer
# window (MLXP_MEGA_PROD) and the plan (neither: the default kernel). DEV begins the benches' tags. Results under $OUT.
#   SW=/tmp/sw OUT=/tmp/win DEV=h200 BUDGET=300 bash experiments/l3_winners.sh
set -u
OUT=${OUT:-/tmp/win}
SW=${SW:-/tmp/sw}
BUDGET=${BUDGET:-300}
source "$(dirname "$0")/stages.sh"
# the variant at prompt 128 whose total is lowest among those starting with $2, if it is at
# least 1% under the default's (596), from sweep file $1; prints its value after the last '='
pick() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
t = {r["variant"]: r["profile_us"]["total"] for r in rows
     if r["prompt"] == 128 and "profile_us" in r and r.get("vs_first", {}).get("identical", True)}
c = {v: s for v, s in t.items() if v.startswith(sys.argv[2]) and "pbulk" not in v and v != "596:prod=1"}
b = min(c, key=c.get) if c else None
print(b.rsplit("=", 1)[1] if b and "596" in t and c[b] < 0.99 * t["596"] else "")
EOF
}
bench() {   # bench TAG ENV...
  local tag=$1; shift
  stage bench-$tag
  env "$@" timeout -s KILL $(lim 5 160) python3 experiments/bench_decode.py --model /tmp/m/8b --tier l1,l3 \
    --lengths 128,2048 --gen 64 --trials 5 --tag ${DEV:-h200}-8b-$tag --out "$OUT/bench-8b-$tag"
  echo "(rc=$?)"
}
{
stage blocks-8b
run $(lim 30 90) python3 experiments/mega_blocks.py --model /tmp/m/8b --out "$OUT/blocks_8b.json"
if [ -s "$OUT/blocks_8b.json" ]; then
  stage sweep-bal
  run $(lim 30 120) python3 experiments/mega_sweep.py --model /tmp/m/8b \
    --variants "596,596:bal=$OUT/blocks_8b.json,596:dyn=1" --prompts 128,2048 --out "$OUT/sweep_bal.json"
fi
P=$(pick "$SW/sweep_8b.json" "596:prod=" 2>/dev/null)
[ -f "$OUT/sweep_bal.json" ] && BAL=$(pick "$OUT/sweep_bal.json" "596:bal=" 2>/dev/null) || BAL=
echo "winners: prod=${P:-none} bal=${BAL:+yes}"
[ -n "$P" ] && bench r1-prod$P MLXP_MEGA_PROD=$P
[ -n "$BAL" ] && bench r1-bal MLXP_MEGA_BAL=$OUT/blocks_8b.json
[ -z "$P$BAL" ] && bench r1      # (neither: the default kernel against mlx-lm)
stage done
} 2>&1 | tee "$OUT/winners.log"
