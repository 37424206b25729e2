"""The Files and Batches APIs (issue 40) through the official Python SDK, against a real
gateway (its embedded Redis, a worker per core) and simulators: a batch runs to its
output file, each custom_id once; a bad file is refused at its first bad line; another
key finds nothing; hostile ids reach no file; a cancel ends it; and a gateway SIGKILLed
mid-batch resumes it after its restart without writing any line twice."""

from __future__ import annotations

import io
import os
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.helpers import Gateway, RedisServer, Sim, metric, wait_for

KEYS = ('[[keys]]\nname = "alice"\nkey = "sk-alice-key"\nrpm = 5\n'
        '[[keys]]\nname = "bob"\nkey = "sk-bob-key"\n')


def jsonl(n: int, model: str = "sim-model", first: int = 0) -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "max_tokens": 2,
                 "messages": [{"role": "user", "content": f"Question {i}?"}]}}) + b"\n"
        for i in range(first, first + n))


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Sim]:
    s = Sim(tmp_path, "b0")
    yield s
    s.stop()


def gateway(tmp_path: Path, sim: Sim, name: str = "gw", extra: str = "",
            front: str = "") -> Gateway:
    """``extra``: [batch] keys; ``front``: [gateway] keys."""
    return Gateway(tmp_path, f'{front}[batch]\ndir = "{tmp_path / "batch"}"\n{extra}' + KEYS
                   + f'[[backends]]\nname = "b0"\nurl = "{sim.url}"\n', name=name,
                   workers=None)


def client(gw: Gateway, key: str = "sk-alice-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def ended(sdk: openai.OpenAI, batch_id: str, within: float = 30) -> Any:
    found: list[Any] = []

    def done() -> bool:
        found[:] = [sdk.batches.retrieve(batch_id)]
        return found[0].status in ("completed", "failed", "expired", "cancelled")
    wait_for(done, within, f"batch {batch_id} ended", every=0.2)
    return found[0]


def submit(sdk: openai.OpenAI, source: bytes, window: str = "24h") -> Any:
    """The file uploaded and a batch of it created."""
    uploaded = sdk.files.create(file=("in.jsonl", io.BytesIO(source)), purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window=window)  # type: ignore[arg-type]


def totals(gw: Gateway) -> dict[str, int]:
    keys = httpx.get(gw.url + "/admin/keys").json()["keys"]
    return next(k["totals"] for k in keys if k["name"] == "alice")


def rows(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(line) for line in sdk.files.content(file_id).content.splitlines()]


def test_a_batch_runs_to_its_output_with_each_custom_id_once(tmp_path: Path, sim: Sim) -> None:
    gw = gateway(tmp_path, sim)
    try:
        sdk = client(gw)
        source = jsonl(20) + jsonl(1, model="no-such-model", first=20)
        uploaded = sdk.files.create(file=("in.jsonl", io.BytesIO(source)), purpose="batch")
        assert uploaded.bytes == len(source) and uploaded.purpose == "batch"
        assert sdk.files.retrieve(uploaded.id).filename == "in.jsonl"
        assert sdk.files.content(uploaded.id).content == source
        assert [f.id for f in sdk.files.list()] == [uploaded.id]
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                   completion_window="24h", metadata={"job": "eval"})
        assert batch.status == "validating" and batch.request_counts.total == 21
        done = ended(sdk, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (20, 1)
        out, errors = rows(sdk, done.output_file_id), rows(sdk, done.error_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"line-{i}" for i in range(20))
        assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["choices"]
                   for r in out)
        assert [(r["custom_id"], r["response"]["status_code"]) for r in errors] == [
            ("line-20", 404)]
        assert [b.id for b in sdk.batches.list()] == [batch.id]
        assert [f.id for f in sdk.files.list(purpose="batch")] == [uploaded.id]
        assert {f.id for f in sdk.files.list(purpose="batch_output")} == {
            done.output_file_id, done.error_file_id}
        assert sdk.batches.retrieve(batch.id).metadata == {"job": "eval"}
        # 21 lines through a key of 5 requests a minute: none of its rpm taken, its
        # tokens counted apart from its interactive ones.
        assert sdk.chat.completions.create(model="sim-model", max_tokens=1, messages=[
            {"role": "user", "content": "hi"}]).choices
        assert metric(gw.url, "gateway_tokens_total", key="alice", model="sim-model",
                      kind="batch_prompt") > 0
        wait_for(lambda: totals(gw)["batch_requests"] == 21, 10, "batch lines counted")
        assert metric(gw.url, "gateway_batch_lines_total", result="completed") == 20
        assert metric(gw.url, "gateway_batch_lines_total", result="failed") == 1
        assert metric(gw.url, "gateway_batches_total", status="completed") == 1
        assert metric(gw.url, "gateway_batch_lines_queued") == 0
        assert metric(gw.url, "gateway_batch_lines_in_flight") == 0
        assert totals(gw)["requests"] == 1
        sdk.files.delete(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(uploaded.id)
    finally:
        gw.stop()


def test_bad_files_and_other_keys_and_hostile_ids_are_refused(tmp_path: Path,
                                                             sim: Sim) -> None:
    gw = gateway(tmp_path, sim, extra="max_file_bytes = 100000\n", front="body_timeout = 1\n")
    try:
        sdk, other = client(gw), client(gw, "sk-bob-key")
        bad = jsonl(2) + b'{"custom_id": "line-0", "method": "POST", "url": ' \
            b'"/v1/chat/completions", "body": {}}\n'
        with pytest.raises(openai.BadRequestError, match="line 3: custom_id 'line-0' is "
                                                         "repeated"):
            sdk.files.create(file=("bad.jsonl", io.BytesIO(bad)), purpose="batch")
        for junk, says in ((b"not json\n", "line 1: not a JSON object"),
                           (b'{"custom_id": "a", "method": "GET", "url": "/v1/models", '
                            b'"body": {}}\n', "line 1: method must be POST")):
            with pytest.raises(openai.BadRequestError, match=says):
                sdk.files.create(file=("bad.jsonl", io.BytesIO(junk)), purpose="batch")
        with pytest.raises(openai.APIStatusError) as big:
            sdk.files.create(file=("big.jsonl", io.BytesIO(jsonl(2000))), purpose="batch")
        assert big.value.status_code == 413
        mine = sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(2))), purpose="batch")
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(mine.id)
        with pytest.raises(openai.BadRequestError, match="input_file_id"):
            other.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="must call /v1/embeddings"):
            sdk.batches.create(input_file_id=mine.id, endpoint="/v1/embeddings",
                               completion_window="24h")
        assert other.files.list().data == []
        for hostile in ("../../etc/passwd", "file-..%2F..%2Fetc%2Fpasswd", "%2e%2e",
                        "file-" + "0" * 23 + "/", "batch_" + "0" * 24, mine.id + ".jsonl"):
            answer = httpx.get(f"{gw.url}/v1/files/{hostile}/content",
                               headers={"authorization": "Bearer sk-alice-key"})
            assert answer.status_code == 404, (hostile, answer.text)
            assert b"root:" not in answer.content
        auth = {"authorization": "Bearer sk-alice-key"}
        for body, headers, says in (
                (b'{"purpose": "batch"}', {"content-type": "application/json"}, "invalid_form"),
                (b"--x\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch"
                 b"\r\n--x--\r\n", {"content-type": "multipart/form-data; boundary=x"},
                 "missing_file"),
                (b"--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n"
                 b"\r\n" + jsonl(1) + b"\r\n--x--\r\n",
                 {"content-type": "multipart/form-data; boundary=x"}, "invalid_purpose")):
            answer = httpx.post(gw.url + "/v1/files", content=body, headers={**auth, **headers})
            assert (answer.status_code, answer.json()["error"]["code"]) == (400, says)
        with socket.create_connection(("127.0.0.1", gw.port)) as slow:  # sends, then stalls
            slow.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         b"sk-alice-key\r\nContent-Type: multipart/form-data; boundary=x\r\n"
                         b"Content-Length: 5000\r\n\r\n--x\r\nContent-Disposition: form-data;")
            slow.settimeout(10)
            assert slow.recv(4096).startswith(b"HTTP/1.1 408 ")
        for body, status, code in ((b"{not json", 400, "invalid_json"),
                                   (b"[1]", 400, "invalid_json"),
                                   (b'{"metadata": "' + b"x" * 70_000 + b'"}', 413,
                                    "body_too_large"),
                                   (b'{"input_file_id": "../../etc/passwd", "endpoint": '
                                    b'"/v1/chat/completions", "completion_window": "24h"}',
                                    400, "invalid_input_file"),
                                   (b'{"input_file_id": "x", "endpoint": "/admin/reload", '
                                    b'"completion_window": "24h"}', 400, "invalid_endpoint"),
                                   (b'{"input_file_id": "x", "endpoint": "/v1/embeddings", '
                                    b'"completion_window": "forever"}', 400,
                                    "invalid_completion_window")):
            answer = httpx.post(gw.url + "/v1/batches", content=body,
                                headers={**auth, "content-type": "application/json"})
            assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
        assert sorted(p.name for p in (tmp_path / "batch").iterdir()) == [mine.id]
        assert httpx.get(gw.url + "/v1/files").status_code == 401
    finally:
        gw.stop()


def test_a_cancelled_batch_stops_dispatching_and_ends_cancelled(tmp_path: Path) -> None:
    slow = Sim(tmp_path, "slow", "--ttft", "0.3")
    gw = gateway(tmp_path, slow, extra="concurrency = 2\n")
    try:
        sdk = client(gw)
        batch = submit(sdk, jsonl(200))
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 2, 30,
                 "some lines done", every=0.2)
        assert metric(gw.url, "gateway_batch_lines_queued") > 100
        shown = httpx.get(gw.url + "/dashboard/data").json()["batches"]  # the status page's
        assert [(b["id"], b["key"], b["status"], b["total"]) for b in shown] == [
            (batch.id, "alice", "in_progress", 200)]
        assert 0 < shown[0]["completed"] < 200
        assert metric(gw.url, "gateway_batch_lines_in_flight") <= 2
        assert sdk.batches.cancel(batch.id).status == "cancelling"
        done = ended(sdk, batch.id)
        assert done.status == "cancelled"
        assert metric(gw.url, "gateway_batch_lines_queued") == 0
        assert metric(gw.url, "gateway_batches_total", status="cancelled") == 1
        assert httpx.get(gw.url + "/dashboard/data").json()["batches"] == []
        assert done.request_counts.completed < 200
        assert len(rows(sdk, done.output_file_id)) == done.request_counts.completed
        with pytest.raises(openai.APIStatusError) as again:
            sdk.batches.cancel(batch.id)
        assert again.value.status_code == 409
    finally:
        gw.stop()
        slow.stop()


def test_a_batch_past_its_window_ends_expired_with_what_finished(tmp_path: Path) -> None:
    slow = Sim(tmp_path, "slow", "--ttft", "0.2")
    gw = gateway(tmp_path, slow, extra="concurrency = 1\n")
    try:
        sdk = client(gw)
        batch = submit(sdk, jsonl(100), window="3s")
        assert batch.expires_at == batch.created_at + 3
        done = ended(sdk, batch.id)
        assert done.status == "expired" and done.expired_at is not None
        assert 0 < done.request_counts.completed < 100
        assert len(rows(sdk, done.output_file_id)) == done.request_counts.completed
    finally:
        gw.stop()
        slow.stop()


def test_a_batch_resumes_after_its_gateway_is_killed_and_writes_each_line_once(
        tmp_path: Path) -> None:
    slow = Sim(tmp_path, "slow", "--ttft", "0.05")
    gw = gateway(tmp_path, slow, extra="concurrency = 4\n")
    try:
        sdk = client(gw)
        batch = submit(sdk, jsonl(300))
        out = tmp_path / "batch" / f"{batch.id}.output.jsonl"
        wait_for(lambda: out.exists() and out.stat().st_size > 2000, 30, "lines written",
                 every=0.05)
        os.killpg(os.getpgid(gw.proc.popen.pid), signal.SIGKILL)
        gw.proc.popen.wait(10)
        written = len(out.read_bytes().splitlines())
        assert 0 < written < 300
        gw = gateway(tmp_path, slow, name="gw")
        sdk = client(gw)
        done = ended(sdk, batch.id, within=60)
        assert done.status == "completed"
        ids = [r["custom_id"] for r in rows(sdk, done.output_file_id)]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(300))  # each once
    finally:
        gw.stop()
        slow.stop()


def test_another_replica_takes_the_batch_over_when_its_runner_dies(tmp_path: Path) -> None:
    """Two replicas on one Redis and one batch directory: the one whose process runs the
    batch (its lease in Redis) is SIGKILLed, the other takes the lease when it lapses and
    finishes the batch, each custom_id once."""
    redis = RedisServer(tmp_path)
    slow = Sim(tmp_path, "slow", "--ttft", "0.05")
    shared = (f'[redis]\nurl = "{redis.url}"\nkey_prefix = "two:"\n'
              f'[batch]\ndir = "{tmp_path / "batch"}"\nconcurrency = 2\n'
              f'[[backends]]\nname = "b0"\nurl = "{slow.url}"\n')
    replicas = [Gateway(tmp_path, shared, name=f"r{i}", workers=None) for i in range(2)]
    try:
        sdk = openai.OpenAI(base_url=replicas[0].url + "/v1", api_key="x", max_retries=0)
        batch = submit(sdk, jsonl(300))
        out = tmp_path / "batch" / f"{batch.id}.output.jsonl"
        wait_for(lambda: out.exists() and out.stat().st_size > 2000, 30, "lines written",
                 every=0.05)
        holder = redis.client().get("two:batch:runner")
        (runner,) = [r for r in replicas if f"batch runner {holder}: this process" in
                     r.proc.output()]
        os.killpg(os.getpgid(runner.proc.popen.pid), signal.SIGKILL)
        runner.proc.popen.wait(10)
        other = next(r for r in replicas if r is not runner)
        done = ended(openai.OpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0),
                     batch.id, within=90)
        assert done.status == "completed"
        ids = [orjson.loads(line)["custom_id"] for line in out.read_bytes().splitlines()]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(300))  # each once
        assert "this process runs the batches" in other.proc.output()
    finally:
        for r in replicas:
            r.stop()
        slow.stop()
        redis.stop()


def test_interactive_requests_go_before_batch_lines(tmp_path: Path) -> None:
    """The simulator's capacity model (2 at once, 0.3 s each) behind a gateway that holds the
    backend to 2: six interactive requests sent while a batch runs are all served before
    any batch line sent after they arrived ends; the batch goes on after them. Two things
    keep that order: the runner sends a line only into a free place nobody waits for, and a
    line that waits anyway never takes the place the queue reserves for a key with fewer
    in flight (without both, this test fails: a line went ahead of an interactive one)."""
    cap = Sim(tmp_path, "cap", "--ttft", "0.3", "--capacity", "2")
    gw = Gateway(tmp_path, f'[batch]\ndir = "{tmp_path / "batch"}"\n' + KEYS
                 + f'[[backends]]\nname = "b0"\nurl = "{cap.url}"\nmax_concurrent = 2\n',
                 name="cap", workers=1)
    try:
        sdk, bob = client(gw), client(gw, "sk-bob-key")
        batch = submit(sdk, jsonl(30))
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 2, 30,
                 "the batch flowing", every=0.05)
        with ThreadPoolExecutor(6) as pool:
            asked = list(pool.map(lambda i: bob.chat.completions.create(
                model="sim-model", max_tokens=1,
                messages=[{"role": "user", "content": f"now {i}"}]), range(6)))
        assert all(a.choices for a in asked)
        assert ended(sdk, batch.id).status == "completed"
        lines = [orjson.loads(raw) for raw in gw.proc.log.read_bytes().splitlines()
                 if b'"msg":"request"' in raw]
        ends = {id(e): _seconds(e["ts"]) for e in lines}
        starts = {id(e): ends[id(e)] - e["duration_ms"] / 1000 for e in lines}
        interactive = [e for e in lines if e["key"] == "bob"]
        batch_lines = [e for e in lines if e["key"] == "alice"]
        arrived = max(starts[id(e)] for e in interactive)
        last = max(ends[id(e)] for e in interactive)
        after = [e for e in batch_lines if starts[id(e)] > arrived]
        assert after, "the batch went on"
        assert all(ends[id(e)] >= last for e in after), (arrived, last, after)
    finally:
        gw.stop()
        cap.stop()


def _seconds(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_creates_at_once_never_pass_the_open_batch_limit(tmp_path: Path) -> None:
    """32 creates sent at once by a key allowed two open batches: two are made, the
    others get a 429 (the record and its count are written by one Redis script)."""
    slow = Sim(tmp_path, "slow", "--ttft", "60")  # the batches stay open
    gw = gateway(tmp_path, slow, extra="max_open_batches = 2\n")
    try:
        sdk = client(gw)
        uploaded = sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(2))), purpose="batch")

        def create(_: int) -> int:
            reply = httpx.post(gw.url + "/v1/batches", timeout=30, json={
                "input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}, headers={"authorization": "Bearer sk-alice-key"})
            return reply.status_code

        with ThreadPoolExecutor(32) as pool:
            codes = sorted(pool.map(create, range(32)))
        assert codes.count(200) <= 2 and set(codes) <= {200, 429}, codes
        made = len(sdk.batches.list().data)
        assert made == codes.count(200) >= 1
        while codes.count(200) < 2:  # refused together: the room is still there
            codes.append(create(0))
        assert create(0) == 429 and len(sdk.batches.list().data) == 2
    finally:
        gw.stop()
        slow.stop()


def test_a_flat_keys_files_stay_its_own_when_the_list_changes(tmp_path: Path,
                                                               sim: Sim) -> None:
    """``api_keys`` are named by their place in the list; what one makes is owned by the
    key itself, so the key that takes its place after an edit finds nothing of it."""
    gw = gateway(tmp_path, sim, front='api_keys = ["sk-first-key", "sk-second-key"]\n')
    try:
        first = client(gw, "sk-first-key")
        mine = first.files.create(file=("in.jsonl", io.BytesIO(jsonl(2))), purpose="batch")
        gw.config_path.write_text(gw.config_path.read_text().replace(
            '"sk-first-key", "sk-second-key"', '"sk-second-key", "sk-first-key"'))
        assert httpx.post(gw.url + "/admin/reload", json={"who": "test"},
                          timeout=30).status_code == 200
        second = client(gw, "sk-second-key")  # now api_keys.0, as sk-first-key was
        assert second.files.list().data == []
        with pytest.raises(openai.NotFoundError):
            second.files.retrieve(mine.id)
        assert [f.id for f in first.files.list()] == [mine.id]  # api_keys.1 now: its own
    finally:
        gw.stop()
