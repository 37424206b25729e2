"""Backends found by DNS: a real DNS server on loopback (dnslib) whose answer for one name
changes while streams run through the gateway. Each address is a simulator on its own
loopback address (127.0.0.N, one port for all, as pods behind a headless Service)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from dnslib import QTYPE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSServer

from tests.helpers import Gateway, Load, Proc, free_port, http_ok, wait_for

NAME = "vllm.test."
INTERVAL, RISE, HEALTH = 0.5, 1, 0.3  # discover_interval, rise, health interval


class Answers(BaseResolver):  # type: ignore[misc]
    """A records for NAME from a list the test changes; NXDOMAIN for any other name."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.lock = threading.Lock()
        self.lookups = 0  # A queries for NAME

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        qname = request.q.qname
        if str(qname) != NAME:
            reply.header.rcode = 3  # NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            with self.lock:
                self.lookups += 1
                for address in self.addresses:
                    reply.add_answer(RR(qname, QTYPE.A, rdata=A(address), ttl=1))
        return reply


@pytest.fixture(scope="module")
def dns() -> Iterator[tuple[Answers, int]]:
    answers, port = Answers(), free_port()
    server = DNSServer(answers, port=port, address="127.0.0.1")
    server.start_thread()
    yield answers, port
    server.stop()


@pytest.fixture(scope="module")
def pods(tmp: Path) -> Iterator[tuple[int, dict[str, Proc]]]:
    port = free_port()
    procs = {}
    for n in (2, 3, 4):
        host = f"127.0.0.{n}"
        procs[host] = Proc(["sim", "--host", host, "--port", str(port), "--itl", "0.02"],
                           tmp / f"pod-{n}.log")
    for host in procs:
        wait_for(lambda h=host: http_ok(f"http://{h}:{port}/health"), 20, f"pod {host}")
    yield port, procs
    for proc in procs.values():
        proc.stop()


def backends(gw: Gateway) -> dict[str, str]:
    states: dict[str, str] = httpx.get(gw.url + "/readyz").json()["backends"]
    return states


def served(host: str, port: int) -> int:
    stats: dict[str, Any] = httpx.get(f"http://{host}:{port}/sim/stats").json()
    return int(stats["completed"])


def test_pods_join_and_leave_with_dns_while_streams_run(
        tmp: Path, dns: tuple[Answers, int], pods: tuple[int, dict[str, Proc]]) -> None:
    answers, dns_port = dns
    port, _ = pods
    answers.addresses = ["127.0.0.2", "127.0.0.3"]
    config = (f"[health]\ninterval = {HEALTH}\nrise = {RISE}\ndiscover_interval = {INTERVAL}\n"
              f'[[backends]]\nname = "vllm"\n'
              f'discover = "dns://127.0.0.1:{dns_port}/{NAME.rstrip(".")}:{port}"\n')
    gw = Gateway(tmp, config, name="discovery", workers=None)  # the default: every core
    try:
        wait_for(lambda: backends(gw) == {"vllm-127.0.0.2": "ready", "vllm-127.0.0.3": "ready"},
                 10, "the two pods DNS lists")
        lookups, began = answers.lookups, time.monotonic()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)

        def stream() -> None:
            chunks = list(client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}],
                max_tokens=40, stream=True))  # about 0.8 s each
            assert chunks[-1].choices[0].finish_reason == "length"

        with Load(stream, threads=6) as load:
            wait_for(lambda: len(load.outcomes) >= 6, 20, "streams running")
            before = served("127.0.0.4", port)
            with answers.lock:
                answers.addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
            # In rotation within one resolve interval plus the rise threshold (and slack
            # for a loaded machine): every worker found it, probed it and routes to it.
            wait_for(lambda: backends(gw).get("vllm-127.0.0.4") == "ready",
                     INTERVAL + RISE * HEALTH + 3, "the new pod in rotation")
            wait_for(lambda: served("127.0.0.4", port) > before, 10, "the new pod serving")
            with answers.lock:
                answers.addresses = ["127.0.0.3", "127.0.0.4"]  # .2 scaled away
            wait_for(lambda: "vllm-127.0.0.2" not in backends(gw), INTERVAL + 3,
                     "the gone pod out of rotation")
            after = len(load.outcomes)
            wait_for(lambda: len(load.outcomes) >= after + 12, 20, "streams after the change")
        assert load.failures == 0, f"{load.failures} of {len(load.outcomes)} streams failed"
        assert set(backends(gw)) == {"vllm-127.0.0.3", "vllm-127.0.0.4"}
        # The control process alone asks DNS: one lookup an interval, however many workers
        # (each worker takes the control process's answers from its snapshot).
        rounds = (time.monotonic() - began) / INTERVAL
        assert answers.lookups - lookups <= rounds + 2, (answers.lookups - lookups, rounds)
    finally:
        gw.stop()


def test_a_dns_outage_keeps_the_backends_found_last(
        tmp: Path, dns: tuple[Answers, int], pods: tuple[int, dict[str, Proc]]) -> None:
    port, _ = pods
    silent = free_port()  # nothing answers DNS there
    config = (f"[health]\ninterval = {HEALTH}\nrise = {RISE}\ndiscover_interval = {INTERVAL}\n"
              f'[[backends]]\nname = "vllm"\n'
              f'discover = "dns://127.0.0.1:{dns[1]}/{NAME.rstrip(".")}:{port}"\n')
    dns[0].addresses = ["127.0.0.3"]
    gw = Gateway(tmp, config, name="dns-outage")
    try:
        wait_for(lambda: backends(gw) == {"vllm-127.0.0.3": "ready"}, 10, "the pod")
        gw.config_path.write_text(gw.config_path.read_text().replace(
            f"127.0.0.1:{dns[1]}/", f"127.0.0.1:{silent}/"))
        reply = httpx.post(gw.url + "/admin/reload", json={"who": "test"}, timeout=30)
        assert reply.status_code == 200, reply.text
        wait_for(lambda: "looking up vllm.test failed" in gw.proc.output(), 15, "a failed lookup")
        assert backends(gw) == {"vllm-127.0.0.3": "ready"}  # kept, not emptied
        done = httpx.post(gw.url + "/v1/chat/completions", timeout=10, json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
        assert done.status_code == 200
    finally:
        gw.stop()
