# Time-boxed stages for the device scripts (experiments/l3_*.sh): source it after setting
# OUT (results) and BUDGET (seconds for the whole script).
#   lim RESERVE MAX   seconds a stage may take: what is left minus RESERVE, at most MAX
#   run SECONDS CMD   CMD killed after SECONDS; prints its exit status
export PYTHONUNBUFFERED=1 MLXP_FIXTURE_DIR=/tmp/fix HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
lim() { local v=$(( $(left) - $1 )); [ "$v" -lt 1 ] && v=1; [ "$v" -gt "$2" ] && v=$2; echo "$v"; }
stage() { echo "### $1 (t=$(( $(date +%s) - T0 ))s, left $(left)s)"; }
run() { local t=$1; shift; timeout -s KILL "$t" "$@"; echo "(rc=$?)"; }
