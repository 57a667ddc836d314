#!/usr/bin/env bash
# The two parts a GPU device run carries (.dev1/, .dev2/: MLX's CUDA wheel split in two, MLX,
# mlx-lm and the wheels engine-serve needs that the device image lacks), made by the shared
# prepare script with this repo's list of extras: the server stack, jsonschema and its
# dependencies (a runtime dependency: without it the first request with a tool schema is a
# 500), llguidance, prometheus_client, and py-spy (experiments/served_profile.py).
# Then: run 1 `mkdir -p /root/parts && cp .dev1/part_aa /root/parts/` carrying [".dev1"];
# run 2 `source .dev2/install-on-device.sh >/dev/null 2>&1; export PYTHONPATH=/tmp/site:.;
# export OUT; STAGES=... bash experiments/runner_gpu.sh` carrying [".dev2"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info
EXTRA="fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn \
opentelemetry-api prometheus_client llguidance>=1.9 jsonschema jsonschema-specifications \
referencing rpds-py attrs py-spy" bash ../shared/device/prepare-mlx-cuda.sh
