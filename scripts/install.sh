#!/usr/bin/env bash
# Create .venv and install the project (with test extras when given "test").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "test" ]; then
  .venv/bin/python -m pip install -q -e '.[test,otel]'
else
  .venv/bin/python -m pip install -q -e .
fi
