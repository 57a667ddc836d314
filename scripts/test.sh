#!/usr/bin/env bash
# Install the package with its test dependencies, then run the test suite.
# Usage: scripts/test.sh [pytest args...]   (default: the whole default suite)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
# mlx-optiq is only the L2 oracle (its KV modules); its other requirements are irrelevant here.
python3 -m pip install -q --no-deps "mlx-optiq==0.7.7"
# mlx-embeddings is the embeddings oracle and mlx-vlm the vision oracle (tests/parity/
# test_vision_parity.py); they import parts of mlx-vlm whose other
# requirements (torch, vision stacks) the checks never touch.
python3 -m pip install -q --no-deps "mlx-embeddings==0.1.0" "mlx-vlm==0.7.10"
# The chat-page test drives a headless Chromium (Debian's chromium + chromium-driver).
# Installed once when missing; where it cannot be installed that test skips and says why.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  fi
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; }; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null 2>&1 \
           && $SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } \
      || echo "scripts/test.sh: could not install chromium; the browser test will skip"
  else
    echo "scripts/test.sh: no chromium and no way to install it (apt-get as root); the browser test will skip"
  fi
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The tests run in parallel worker processes (pytest-xdist), one per CPU up to 4 (PYTEST_WORKERS
# overrides; 0 runs them in this process), a test file to a worker: the suite's tests are
# mostly single-threaded, so on a 2-core machine this halves the wall time.
WORKERS=${PYTEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); echo $(( n < 4 ? n : 4 )))}
set +e
if [ "$WORKERS" -gt 0 ]; then
  python3 -m pytest -q -n "$WORKERS" --dist loadfile "$@"
else
  python3 -m pytest -q "$@"
fi
rc=$?
set -e
# pytest exit 5 = no tests collected (e.g. a -k filter that matches nothing)
if [ "$rc" -eq 5 ]; then echo "no tests collected"; exit 0; fi
exit "$rc"
