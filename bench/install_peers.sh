#!/usr/bin/env bash
# Install the peers the comparison runs against, each in its own venv under bench/.peers/.
# nginx and wrk come from Debian; vllm-router and the LiteLLM proxy from PyPI (pinned);
# matplotlib (the bench extra, for the plot) goes into the project's ../.venv.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! command -v nginx >/dev/null; then
  apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null
fi
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
command -v taskset >/dev/null || { apt-get update -qq && apt-get install -y -qq util-linux; }
# The plot in docs/BENCHMARKS.md needs the bench extra in the project's venv.
if [ -x ../.venv/bin/python ] && ! ../.venv/bin/python -c 'import matplotlib' 2>/dev/null; then
  ../.venv/bin/python -m pip install -q -e '..[bench]'
fi
mkdir -p .peers
if [ ! -x .peers/router/bin/vllm-router ]; then
  "$PY" -m venv .peers/router
  .peers/router/bin/pip install -q 'vllm-router==0.1.17'
fi
if [ ! -x .peers/litellm/bin/litellm ]; then
  "$PY" -m venv .peers/litellm
  .peers/litellm/bin/pip install -q 'litellm[proxy]==1.106.12'
fi
echo "peers ready: $(nginx -v 2>&1), vllm-router 0.1.17, litellm 1.106.12 (1.108+ needs litellm-proxy, not on PyPI)"
