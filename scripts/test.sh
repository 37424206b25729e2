#!/usr/bin/env bash
# Install with test extras and real vLLM, then lint, type-check and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
bash scripts/install_tools.sh
bash scripts/prepare_vllm.sh
.venv/bin/ruff check gateway backends tests bench
.venv/bin/mypy
.venv/bin/pytest -q "$@"
