#!/usr/bin/env bash
# Issue 41 point 5 on the GPU host: 16 locally built random-weight LoRA adapters of the
# random-weight 0.5B Llama, on four instances of it spawned by one gateway on GPU 0
# (--gpu-memory-utilization $GPU_UTIL each, LoRA with --max-loras 2, --max-cpu-loras 16),
# Zipf traffic (s 1.1) over the adapters. One gateway run per arm:
#   aware        routing.policy = "least_loaded", adapter_affinity = true (the default):
#                an adapter's requests go to the instances running it, then having it
#   round_robin  routing.policy = "round_robin", adapter_affinity = false: every instance
#                in turn, each loading whichever adapter it is sent
# Both load adapters on demand (the gateway's /v1/load_lora_adapter, counted).
# Run from the repo root after .gpu/install.sh, each phase unpiped (`> file 2>&1`):
#
#   bash bench/gpu/lora.sh models          # the base model and the 16 adapters
#   ARMS="aware round_robin" bash bench/gpu/lora.sh load   # -> $OUT/lora.jsonl
#   bash bench/gpu/lora.sh report
#
# SECONDS_PER_ARM (180), RATE (8 req/s), MAX_TOKENS (64), ADAPTERS (16), GATEWAY_SRC
# (default: this checkout), OUT. SIM=1: simulators with LoRA (a 0.2 s load) instead of
# vLLM, to check the flow on a machine without a GPU (SIM_ITL: seconds per token, 0.01;
# a batch runs at most --max-loras adapters, others wait, as in vLLM's scheduler).
# URLS="http://127.0.0.1:8001 ...": instances already running (with LoRA and
# VLLM_ALLOW_RUNTIME_LORA_UPDATING, serving BASE: `test` for cache_routing.sh's with
# LORA=1; default `base`), as url backends with `lora = true`:
# both arms use the same instances (no start per arm); before each arm every adapter is
# unloaded from every instance, so each arm starts with none loaded.
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${WORKDIR:-/tmp/gw-lora}
PY=${PY:-$(python3 -c 'import sys; print(sys.executable)')}
GATEWAY_SRC=$(readlink -f "${GATEWAY_SRC:-$PWD}")
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
OUT=${OUT:-$W/out}
ARMS=${ARMS:-aware round_robin}
N=${ADAPTERS:-16}
BASE=${BASE:-base}
URLS=${URLS:-}
PORT=9400
mkdir -p "$W/logs" "$OUT"
ulimit -n "$(ulimit -Hn)"
names() { for i in $(seq 1 "$N"); do printf 'a%02d\n' "$i"; done; }

models() {
  if [ -z "${SIM:-}" ]; then
    [ -f "$W/model/config.json" ] || $PY .gpu/make_model.py "$W/model" > "$W/logs/make_model.log" 2>&1 \
      || { tail "$W/logs/make_model.log"; exit 4; }
  fi
  local i=0 a
  for a in $(names); do
    i=$((i + 1))
    [ -f "$W/adapters/$a/adapter_config.json" ] && continue
    if [ -n "${SIM:-}" ]; then  # the simulator reads no weights; the check reads the rank
      mkdir -p "$W/adapters/$a" && echo '{"r": 8, "lora_alpha": 16}' > "$W/adapters/$a/adapter_config.json"
    else
      $PY -m backends.tinylora "$W/adapters/$a" --base "$W/model" --seed "$i" \
        >> "$W/logs/tinylora.log" 2>&1 || { tail "$W/logs/tinylora.log"; exit 4; }
    fi
  done
  echo "model and $N adapters ready in $W"
}

config() {  # arm
  printf '[gateway]\nlisten = "127.0.0.1:%s"\n' "$PORT"
  printf '[redis]\ndata_dir = "%s/valkey-%s"\n' "$W" "$1"
  printf '[supervisor]\nlog_dir = "%s/logs/%s"\nsequential_start = true\n' "$W" "$1"
  printf '[health]\nmetrics_interval = 1.0\n'
  case "$1" in
    aware) printf '[routing]\npolicy = "least_loaded"\nadapter_affinity = true\n' ;;
    round_robin) printf '[routing]\npolicy = "round_robin"\nadapter_affinity = false\n' ;;
  esac
  local a n
  for a in $(names); do
    printf '\n[[adapters]]\nname = "%s"\nbase = "%s"\npath = "%s/adapters/%s"\n' "$a" "$BASE" "$W" "$a"
  done
  local u n=0
  for u in $URLS; do
    n=$((n + 1)); printf '\n[[backends]]\nname = "v%d"\nurl = "%s"\nlora = true\n' "$n" "$u"
  done
  [ -n "$URLS" ] && return 0
  for n in 1 2 3 4; do
    printf '\n[[backends]]\nname = "v%d"\n[backends.spawn]\nport = %d\n' "$n" "$((8400 + n))"
    printf 'served_model_name = "base"\nlora = { max_loras = 2, max_lora_rank = 8, max_cpu_loras = %d }\n' "$N"
    if [ -n "${SIM:-}" ]; then
      printf 'model = "base"\ncommand = ["{python}", "-m", "gateway", "sim", "--port", "{port}", '
      printf '"--model", "{served_model_name}", "--enable-lora", "--max-loras", "2", '
      printf '"--lora-load-delay", "0.2", "--ttft", "0.02", "--itl", "%s"]\n' "${SIM_ITL:-0.01}"
    else
      printf 'model = "%s/model"\ngpus = [0]\n' "$W"
      printf 'args = ["--gpu-memory-utilization", "%s", "--enforce-eager", "--max-model-len", "4096"]\n' \
        "${GPU_UTIL:-0.2}"
      printf 'env = { VLLM_USE_FLASHINFER_SAMPLER = "0" }\n'
    fi
  done
}

unload_all() {  # every adapter off every url instance: each arm starts with none loaded
  local u a
  for u in $URLS; do
    for a in $(names); do
      curl -s -o /dev/null -X POST "$u/v1/unload_lora_adapter" -H 'content-type: application/json' \
        -d "{\"lora_name\": \"$a\"}"
    done
  done
}

one_arm() {  # arm
  local arm=$1
  [ -n "$URLS" ] && unload_all
  config "$arm" > "$W/gw-$arm.toml"
  env -C "$GATEWAY_SRC" PYTHONPATH="/tmp/site:$GATEWAY_SRC" $PY -m gateway check \
    --config "$W/gw-$arm.toml" || exit 5
  env -C "$GATEWAY_SRC" PYTHONPATH="/tmp/site:$GATEWAY_SRC" setsid nohup $PY -m gateway serve \
    --config "$W/gw-$arm.toml" > "$W/logs/gw-$arm.log" 2>&1 < /dev/null &
  local gw=$! want=4
  [ -n "$URLS" ] && want=$(wc -w <<< "$URLS")
  for _ in $(seq 1 2400); do  # the instances start one after another: minutes on a GPU
    s=$(curl -sf "http://127.0.0.1:$PORT/admin/status") && [ "$(grep -o '"ready"' <<< "$s" | wc -l)" -ge "$want" ] \
      && break
    sleep 0.5
  done
  $PY -m bench.gpu_lora --gateway "http://127.0.0.1:$PORT" --adapters "$(names | paste -sd,)" \
    --arm "$arm" --seconds "${SECONDS_PER_ARM:-180}" --rate "${RATE:-8}" \
    --max-tokens "${MAX_TOKENS:-64}" --out "$OUT/lora.jsonl" --requests "$OUT/requests.jsonl"
  grep -hE "adapter .* (loaded|not loaded)" "$W/logs/gw-$arm.log" | tail -60 > "$OUT/loads-$arm.log"
  kill -TERM "$gw"; wait "$gw" 2>/dev/null
}

case "${1:-}" in
  models) models ;;
  load) for a in $ARMS; do one_arm "$a"; done ;;
  report) $PY -m bench.gpu_lora --summary "$OUT/lora.jsonl" ;;
  *) echo "usage: $0 models|load|report"; exit 2 ;;
esac
