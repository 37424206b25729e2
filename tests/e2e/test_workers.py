"""`[gateway] workers = N`: N real worker processes behind one port."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai

from tests.helpers import Gateway, Sim, backend_toml, http_ok, wait_for


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_workers_serve_and_stop_with_the_gateway(tmp: Path, sims: tuple[Sim, Sim]) -> None:
    a, _ = sims
    gw = Gateway(tmp, "workers = 2\n[routing]\nsticky = false\n[breaker]\nshare = false\n"
                 "[degraded]\ncache = false\n" + backend_toml("a", a.url),
                 name="workers")
    try:
        wait_for(lambda: http_ok(gw.url + "/readyz"), 20, "workers ready")
        pids: set[int] = set()

        def both_seen() -> bool:
            # A fresh connection each time, so either worker may accept it.
            pids.add(httpx.get(gw.url + "/healthz", headers={"connection": "close"}).json()["pid"])
            return len(pids) == 2

        wait_for(both_seen, 20, "both workers to answer")
        assert gw.proc.popen.pid not in pids
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for _ in range(10):
            reply = client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            assert reply.choices[0].message.content == " tok0"
        assert gw.proc.output().count("the gateway is open") == 1
    finally:
        gw.proc.popen.send_signal(signal.SIGTERM)
        gw.proc.popen.wait(20)
        gw.stop()
    wait_for(lambda: not any(_alive(p) for p in pids), 10, "workers to exit with the gateway")
