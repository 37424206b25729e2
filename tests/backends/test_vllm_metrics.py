"""Reading vLLM's own load report, and what the policy makes of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.backend import Backend, LoadReport
from backends.vllm_metrics import Nvml, lora_info, parse
from gateway.routing.policies import LeastLoaded
from tests import factories

# As vLLM 0.x writes it: labels, HELP/TYPE lines, histograms beside the gauges.
PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 800.0
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
"""


def test_the_load_report_is_read_and_summed_over_engines() -> None:
    assert parse(PAGE) == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.25,
                           "queries": 1000.0, "hits": 800.0}


def backend(name: str, in_flight: int, load: LoadReport | None) -> Backend:
    return factories.backend(name, ready=True, in_flight=in_flight, load=load)


def test_least_loaded_counts_what_other_clients_put_on_a_backend() -> None:
    request = factories.request()
    busy_elsewhere = backend("a", 0, LoadReport(running=6, waiting=4))
    quiet = backend("b", 1, LoadReport(running=1, waiting=0))
    policy = LeastLoaded()
    assert {policy.choose([busy_elsewhere, quiet], request).name for _ in range(4)} == {"b"}
    assert busy_elsewhere.queue == 10 and quiet.queue == 1
    assert backend("c", 3, None).queue == 3  # no report: our own count


def test_without_a_gpu_nvml_reports_nothing() -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU")
    nvml = Nvml()
    assert not nvml.available and nvml.read([0]) == ()


# vLLM 0.32 (v1/metrics/loggers.py): every set of labels stays a sample of its own, its
# value the time it was set; the newest says what runs now.
LORA = 'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{}",' \
    'waiting_lora_adapters="{}"}} {}\n'
LORA_PAGE = ("# HELP vllm:lora_requests_info Running stats on lora requests.\n"
             "# TYPE vllm:lora_requests_info gauge\n"
             + LORA.format("a1,a2", "", "1.7650001e+09")
             + LORA.format("a3", "a1", "1.7650002e+09")
             + LORA.format("", "", "1.7650000e+09"))


def test_the_adapters_running_are_read_from_the_newest_lora_sample() -> None:
    assert lora_info(LORA_PAGE) == (("a3",), 2)
    assert lora_info(PAGE) == ((), None)  # no LoRA: nothing said
    assert parse(LORA_PAGE) == {}
