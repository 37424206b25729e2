set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH="/tmp/site:$PWD"
python3 -c "import pynvml; print('nvidia-ml-py', pynvml.__version__ if hasattr(pynvml,'__version__') else '?')"
mkdir -p /tmp/nv && cat > /tmp/nv/gw.toml <<TOML
[gateway]
listen = "127.0.0.1:9400"
log_format = "text"
[routing]
sticky = false
[breaker]
share = false
[degraded]
cache = false
[health]
interval = 0.5
metrics_interval = 0.5
[supervisor]
log_dir = "/tmp/nv/logs"
[[backends]]
name = "gpu0"
[backends.spawn]
model = "sim-model"
port = 8501
gpus = [0]
command = ["{python}", "-m", "gateway", "sim", "--port", "{port}", "--model", "{model}"]
TOML
python3 -m gateway serve --config /tmp/nv/gw.toml > /tmp/nv/gw.log 2>&1 &
for _ in $(seq 1 60); do curl -sf localhost:9400/readyz >/dev/null && break; sleep 0.5; done
sleep 2
curl -s localhost:9400/metrics | grep -E "^gateway_backend_(gpu|requests_running|kv)" | tee $OUT/metrics.txt
curl -s localhost:9400/dashboard/data | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps(d["backends"][0]["gpus"]))'
nvidia-smi --query-gpu=index,memory.used,memory.total,temperature.gpu --format=csv
tail -3 /tmp/nv/gw.log
