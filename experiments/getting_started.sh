#!/usr/bin/env bash
# Times docs/getting-started.md end to end, as a newcomer runs it: a fresh clone, a fresh
# venv, empty caches (built-in model, Hugging Face hub, MLX kernel cache), then
# serve the built-in model, write a transformers-layout fixture, convert + quantize it,
# serve it and chat once in the page (headless chromium, if installed).
# Usage: bash experiments/getting_started.sh [REPO_URL_OR_PATH] [BRANCH]
# Prints one "step<TAB>seconds" line per step.
set -euo pipefail
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
BRANCH=${2:-$(git -C "$SRC" rev-parse --abbrev-ref HEAD)}
WORK=$(mktemp -d /tmp/getting-started.XXXXXX)
PORT1=${PORT1:-8190}; PORT2=${PORT2:-8191}
export XDG_CACHE_HOME=$WORK/cache HF_HUB_CACHE=$WORK/hub TMPDIR=$WORK/tmp
unset MLXP_FIXTURE_DIR PYTHONPATH
mkdir -p "$TMPDIR"
now() { date +%s.%N; }
step() { printf '%s\t%.1f\n' "$1" "$(echo "$(now) - $2" | bc)"; }
wait_line() {  # file pattern pid
  until grep -q "$2" "$1" 2>/dev/null; do
    kill -0 "$3" 2>/dev/null || { cat "${1%.out}.err"; exit 1; }; sleep 0.1; done; }
ask() { curl -sS "http://127.0.0.1:$1/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"messages":[{"role":"user","content":"Hello!"}],"max_tokens":64}' >/dev/null; }

cd "$WORK"
t=$(now); git clone -q --branch "$BRANCH" "$SRC" mlx-parity; step "git clone" "$t"
cd mlx-parity
t=$(now); python3 -m venv .venv && . .venv/bin/activate && python -m pip install -q -e . 2>/dev/null
step "venv + pip install -e ." "$t"

t=$(now); engine-serve --port "$PORT1" >"$WORK/s1.out" 2>"$WORK/s1.err" & P=$!
wait_line "$WORK/s1.out" "try:" $P; step "engine-serve (built-in model) ready" "$t"
t=$(now); ask "$PORT1"; step "first request (kernels compile)" "$t"
t=$(now); ask "$PORT1"; step "second request (max_tokens 64)" "$t"
kill $P; wait $P 2>/dev/null || true

t=$(now); python -m pip install -q transformers 2>/dev/null; step "pip install transformers" "$t"
t=$(now); python -m parity.hf_layout --family llama --out hf-llama >/dev/null 2>&1
step "write a transformers-layout checkpoint" "$t"
t=$(now); engine-convert --hf-path hf-llama --mlx-path llama-4bit -q 2>/dev/null
step "engine-convert -q (4-bit)" "$t"

t=$(now); engine-serve --model llama-4bit --port "$PORT2" >"$WORK/s2.out" 2>"$WORK/s2.err" & P=$!
wait_line "$WORK/s2.out" "try:" $P; step "engine-serve --model llama-4bit ready" "$t"
t=$(now); ask "$PORT2"; step "first request (kernels compile)" "$t"
t=$(now); ask "$PORT2"; step "second request (max_tokens 64)" "$t"
if command -v chromium >/dev/null && command -v chromedriver >/dev/null \
   && python -m pip install -q selenium 2>/dev/null; then
  t=$(now); python experiments/chat_screenshot.py --url "http://127.0.0.1:$PORT2" \
    --out "$WORK/chat.png" >/dev/null; step "chat once in the page (browser start included)" "$t"
fi
kill $P; wait $P 2>/dev/null || true
echo "workdir: $WORK"
