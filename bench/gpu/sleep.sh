#!/usr/bin/env bash
# Issue 39 point 6 on the GPU host: three models that do not fit awake together on one GPU,
# each spawned by one gateway (the product path), with Zipf traffic whose favourite rotates
# so that each model in turn sleeps (or stops) and is asked again. One arm per gateway run:
#   level1   sleep_after, sleep_level = 1 (weights offloaded to host memory)
#   level2   sleep_after, sleep_level = 2 (weights discarded, reloaded at the wake)
#   cold     stop_after instead: what fits stays up, the rest start cold when asked
# Three random-weight 0.5B Llamas of different seeds (.gpu/make_model.py --seed N), each
# --gpu-memory-utilization $GPU_UTIL (0.4: two fit awake, three do not), --enforce-eager.
# Run from the repo root after .gpu/install.sh, each phase unpiped (`> file 2>&1`):
#
#   bash bench/gpu/sleep.sh models         # the three models (~25 s each)
#   ARMS="level1 level2 cold" bash bench/gpu/sleep.sh load   # -> $OUT/sleep.jsonl
#   bash bench/gpu/sleep.sh report
#
# IDLE: sleep_after / stop_after seconds (20); SECONDS_PER_ARM (240), RATE (1.5 req/s),
# ROTATE (60 s per favourite), GATEWAY_SRC (default: this checkout), OUT.
# SIM=1: simulators with sleep mode (wake delay 0.5 s) instead of vLLM, to check the flow.
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${WORKDIR:-/tmp/gw-sleep}
PY=${PY:-$(python3 -c 'import sys; print(sys.executable)')}
GATEWAY_SRC=$(readlink -f "${GATEWAY_SRC:-$PWD}")
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
OUT=${OUT:-$W/out}
ARMS=${ARMS:-level1 level2 cold}
PORT=9300
mkdir -p "$W/logs" "$OUT"
ulimit -n "$(ulimit -Hn)"

models() {
  [ -n "${SIM:-}" ] && return 0
  for n in 1 2 3; do
    [ -f "$W/model-$n/config.json" ] || $PY .gpu/make_model.py "$W/model-$n" --seed "$n" \
      > "$W/logs/make_model-$n.log" 2>&1 || { tail "$W/logs/make_model-$n.log"; exit 4; }
  done
  echo "models ready"
}

config() {  # arm
  printf '[gateway]\nlisten = "127.0.0.1:%s"\n' "$PORT"
  printf '[redis]\ndata_dir = "%s/valkey-%s"\n' "$W" "$1"
  printf '[supervisor]\nlog_dir = "%s/logs/%s"\nsequential_start = true\n' "$W" "$1"
  printf '[health]\nmetrics_interval = 1.0\n'
  local idle=${IDLE:-20} n
  for n in 1 2 3; do
    printf '\n[[backends]]\nname = "m%d"\n[backends.spawn]\nport = %d\n' "$n" "$((8100 + n))"
    printf 'served_model_name = "m%d"\nwake_timeout = 300\n' "$n"
    if [ -n "${SIM:-}" ]; then
      printf 'model = "m%d"\ncommand = ["{python}", "-m", "gateway", "sim", "--port", "{port}", ' "$n"
      printf '"--model", "{served_model_name}", "--enable-sleep-mode", "--wake-delay", "0.5", '
      printf '"--ttft", "0.02", "--seed", "%d"]\n' "$n"
    else
      printf 'model = "%s/model-%d"\ngpus = [0]\n' "$W" "$n"
      printf 'args = ["--gpu-memory-utilization", "%s", "--enforce-eager", "--max-model-len", "4096"]\n' \
        "${GPU_UTIL:-0.4}"
      printf 'env = { VLLM_USE_FLASHINFER_SAMPLER = "0" }\n'
    fi
    case "$1" in
      level1) printf 'sleep_after = %s\nsleep_level = 1\n' "$idle" ;;
      level2) printf 'sleep_after = %s\nsleep_level = 2\n' "$idle" ;;
      cold) printf 'stop_after = %s\n' "$idle"; [ "$n" = 3 ] && printf 'start = "on_demand"\n' ;;
    esac
  done
}

one_arm() {  # arm
  local arm=$1 nvml="$W/logs/nvml-$1.csv"
  config "$arm" > "$W/gw-$arm.toml"
  env -C "$GATEWAY_SRC" PYTHONPATH="/tmp/site:$GATEWAY_SRC" $PY -m gateway check \
    --config "$W/gw-$arm.toml" || exit 5
  env -C "$GATEWAY_SRC" PYTHONPATH="/tmp/site:$GATEWAY_SRC" setsid nohup $PY -m gateway serve \
    --config "$W/gw-$arm.toml" > "$W/logs/gw-$arm.log" 2>&1 < /dev/null &
  local gw=$!
  for _ in $(seq 1 2400); do  # the instances start one after another: minutes on a GPU
    s=$(curl -sf "http://127.0.0.1:$PORT/admin/status") && ! grep -q '"starting"' <<< "$s" \
      && break
    sleep 0.5
  done  # all up (or stopped, on demand) before the arm: its counts are the traffic's
  : > "$nvml"
  if [ -z "${SIM:-}" ]; then
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 \
      > "$nvml" 2>/dev/null & local smi=$!
  fi
  $PY -m bench.gpu_sleep --gateway "http://127.0.0.1:$PORT" --models m1,m2,m3 --arm "$arm" \
    --seconds "${SECONDS_PER_ARM:-240}" --rate "${RATE:-1.5}" --rotate "${ROTATE:-60}" \
    --nvml "$nvml" --out "$OUT/sleep.jsonl" --requests "$OUT/requests.jsonl"
  [ -n "${smi:-}" ] && kill "$smi" 2>/dev/null
  grep -hE "backend m[0-9]: [a-z]+ -> [a-z]+" "$W/logs/gw-$arm.log" | tail -40 > "$OUT/transitions-$arm.log"
  kill -TERM "$gw"; wait "$gw" 2>/dev/null
}

case "${1:-}" in
  models) models ;;
  load) for a in $ARMS; do one_arm "$a"; done ;;
  report) $PY -m bench.gpu_sleep --summary "$OUT/sleep.jsonl" ;;
  *) echo "usage: $0 models|load|report"; exit 2 ;;
esac
