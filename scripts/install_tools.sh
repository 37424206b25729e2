#!/usr/bin/env bash
# System tools the tests drive: headless chromium (the status page), docker-compose v1 and
# promtool (the compose stack, validated without an engine), wrk and nginx (the worker
# scaling benchmark's smoke run), node and npm (the Node SDK tests). From Debian, when missing.
set -euo pipefail
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v promtool >/dev/null || need+=(prometheus)
command -v wrk >/dev/null || need+=(wrk)
command -v nginx >/dev/null || need+=(nginx-light)
command -v npm >/dev/null || need+=(nodejs npm)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The official OpenAI Node SDK, at the version tests/node/package-lock.json pins.
(cd "$(dirname "$0")/../tests/node" && npm ci --no-audit --no-fund --silent)
echo "tools: node $(node --version); $(chromium --version 2>/dev/null | head -1); $(docker-compose version --short 2>/dev/null); $(promtool --version 2>&1 | head -1); $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2); $(nginx -v 2>&1)"
