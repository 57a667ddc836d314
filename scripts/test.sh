#!/usr/bin/env bash
# Install the package with its test dependencies, then run the test suite.
# Usage: scripts/test.sh [pytest args...]   (default: the whole default suite)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
# mlx-optiq is only the L2 oracle (its KV modules); its other requirements are irrelevant here.
python3 -m pip install -q --no-deps "mlx-optiq==0.7.7"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
set +e
python3 -m pytest -q "$@"
rc=$?
set -e
# pytest exit 5 = no tests collected (e.g. a -k filter that matches nothing)
if [ "$rc" -eq 5 ]; then echo "no tests collected"; exit 0; fi
exit "$rc"
