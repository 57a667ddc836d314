#!/bin/bash
# Device run: where the one-kernel step's warps stall (Nsight Compute on the H200), results
# under $OUT: for each model in MODELS (default "1b 1b-q4 8b"), one launch of the mega kernel
# (after warm-up launches) profiled with the speed-of-light, memory, scheduler, warp-state
# (stall reasons: grid barrier waits show as CTA barrier, weight loads as long scoreboard,
# shared-memory reads as short scoreboard / MIO throttle) and occupancy sections; then (RAW=0
# leaves out) the warp-state section's raw metrics: cycles stalled per issued instruction,
# one column per reason.
#   OUT=/tmp/ncu BUDGET=400 bash experiments/l3_ncu.sh
set -u
OUT=${OUT:-/tmp/ncu}
BUDGET=${BUDGET:-400}
source "$(dirname "$0")/stages.sh"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
{
echo "ncu: ${NCU:-none}"
[ -n "$NCU" ] || exit 2
for m in ${MODELS:-1b 1b-q4 8b}; do
  stage "build-$m"
  case $m in
    *-q4) python3 -m experiments.presets "${m%-q4}" "/tmp/m/$m" --bits 4 ;;
    *) python3 -m experiments.presets "$m" "/tmp/m/$m" ;;
  esac
  stage "ncu-$m"
  run $(lim 5 180) "$NCU" --kernel-name regex:mega --launch-skip ${SKIP:-6} --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    --csv --page details python3 experiments/mega_check.py --model "/tmp/m/$m" --steps 12 \
    --out "$OUT/mega_check_$m.json" > "$OUT/ncu_$m.csv"
  grep -i "stall\|throughput\|duration\|warp cycles" "$OUT/ncu_$m.csv" | head -60
  if [ "${RAW:-1}" = 1 ]; then      # the stall reasons, one column each (the raw page)
    stage "ncu-raw-$m"
    run $(lim 5 150) "$NCU" --kernel-name regex:mega --launch-skip ${SKIP:-6} --launch-count 1 \
      --section WarpStateStats --csv --page raw python3 experiments/mega_check.py --model "/tmp/m/$m" \
      --steps 12 > "$OUT/ncu_raw_$m.csv"
    python3 - "$OUT/ncu_raw_$m.csv" <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is not None:
    rows = list(csv.reader(lines[start:]))
    for name, val in sorted(zip(rows[0], rows[-1]), key=lambda kv: kv[0]):
        if "stalled" in name and "ratio" in name:
            print(name, val)
PY
  fi
done
stage done
} 2>&1 | tee "$OUT/ncu.log"
