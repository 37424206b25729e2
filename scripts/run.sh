#!/usr/bin/env bash
# Install, then run the gateway with ./config.toml in front of two local simulators.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
mkdir -p logs
.venv/bin/vllm-gateway sim --port 8001 --itl 0.02 >logs/sim-a.log 2>&1 &
A=$!
.venv/bin/vllm-gateway sim --port 8002 --itl 0.02 >logs/sim-b.log 2>&1 &
B=$!
trap 'kill $A $B 2>/dev/null || true' EXIT
exec_status=0
.venv/bin/vllm-gateway serve --config "${CONFIG:-config.toml}" || exec_status=$?
exit $exec_status
