"""The status page's header: the gateway's version, age and Grafana link."""

from __future__ import annotations

import os
import subprocess
import time

from gateway.observability.routes import About, started


def test_a_process_start_agrees_with_ps() -> None:
    for pid in (1, os.getppid(), os.getpid()):
        age = int(subprocess.run(["ps", "-o", "etimes=", "-p", str(pid)], capture_output=True,
                                 text=True, check=True).stdout)
        assert abs(started(pid) - (time.time() - age)) <= 2  # ps and btime: whole seconds


def test_a_process_that_is_gone_counts_from_now() -> None:
    before = time.time()
    assert before <= started(2**22 + 12345) <= time.time()


def test_the_header_data() -> None:
    about = About("1.2.3", started=1000.0, grafana_url="http://g:3000/d/x")
    assert about.data(now=1060.25) == {"version": "1.2.3", "pid": os.getpid(),
                                       "uptime_s": 60.2, "grafana_url": "http://g:3000/d/x"}


def test_a_grafana_url_is_shown_without_its_credentials() -> None:
    about = About(grafana_url="https://admin:s3cret@grafana.example:3000/d/x?orgId=1")
    assert about.data(now=0)["grafana_url"] == "https://grafana.example:3000/d/x?orgId=1"
