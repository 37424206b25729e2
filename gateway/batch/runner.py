"""The one runner of a deployment: whichever serving process holds the lease in Redis
(taken over within ``LEASE`` seconds when its holder dies) runs every open batch.

A batch's lines go through the gateway's own proxy, as its owner's key but in the queue's
``BATCH_BAND``, below every interactive band (priorities are 0 to 9), with no rpm/tpm of
the key's taken (their tokens are counted apart: ``batch_``);
a line is sent only while nobody waits in this process's queue and one of its model's
backends has room (under its capacity, or vLLM queueing nothing), within the band's share
(``gateway.batch.share``: it grows while no interactive request waits, halves when one
does) and never more than ``concurrency`` at once; lines that share a prompt's head go
together (sorted by it), so vLLM's prefix cache serves them. Each result is appended to
the batch's output or error file in one ``write`` (a line cut by a kill is dropped on
resume): after a restart, the lines whose ``custom_id`` has a result are skipped, so each
is written once."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.types import ASGIApp, Message

from gateway.batch import results
from gateway.batch.lines import Line
from gateway.batch.share import Share
from gateway.batch.store import Store, StoreUnavailable, new_id, now
from gateway.http.auth import TENANT
from gateway.metrics import Metrics
from gateway.routing.pool import BackendPool
from gateway.routing.queue import WaitQueue
from gateway.tenants.keyring import Keyring, Tenant
from gateway.types import BATCH_BAND

log = logging.getLogger("gateway.batch")

LEASE = 5.0  # seconds the runner's lease lasts unrenewed (renewed each TICK)
TICK = 1.0  # seconds between the runner's looks (lease, new batches, cancels, counts)
GATE = 0.02  # seconds between looks for idle capacity while lines wait
ENDED = ("completed", "failed", "expired", "cancelled")
RETRIED = (429, 502, 503, 504)  # "not now": a line so answered is sent again, up to RETRIES
RETRIES = 4  # times, 1, 2, 4 and 8 s apart
WINDOW = re.compile(r"(\d{1,6})([smh])")


def window_seconds(text: str) -> int | None:
    found = WINDOW.fullmatch(text)
    if found is None:
        return None
    return int(found[1]) * {"s": 1, "m": 60, "h": 3600}[found[2]]


class Runner:
    def __init__(self, store: Store, proxy: ASGIApp, pool: BackendPool, queue: WaitQueue,
                 tenants: Callable[[], Keyring], concurrency: int,
                 metrics: Metrics) -> None:
        self.store = self._store = store
        self.metrics = metrics
        self._proxy = proxy
        self._pool = pool
        self._queue = queue
        self._tenants = tenants
        self._slots = asyncio.Semaphore(concurrency)
        self.share = Share(concurrency)
        self._me = new_id("runner-")
        self._running: dict[str, asyncio.Task[None]] = {}
        self._until = 0.0  # monotonic time the lease surely holds until (renewed before)

    @property
    def leads(self) -> bool:
        """The lease surely still ours: a result is written only then (a process paused
        past its lease finds another runner took over, and writes nothing)."""
        return time.monotonic() < self._until

    async def run(self) -> None:
        """Hold the lease (or wait for it) and run the open batches while holding it; a
        Redis error keeps the batches running until the lease would have lapsed."""
        led = False
        try:
            while True:
                asked = time.monotonic()
                try:
                    leading = await self._store.lead(self._me, LEASE)
                    if leading:
                        self._until = asked + LEASE - TICK
                        await self._start_open()
                except StoreUnavailable:
                    leading = self.leads
                if leading != led:
                    log.info("batch runner %s: %s", self._me,
                             "this process runs the batches" if leading else "lease lost")
                    led = leading
                if not leading:
                    self._stop_all()
                await asyncio.sleep(TICK)
        finally:
            self._stop_all()

    def _stop_all(self) -> None:
        for task in self._running.values():
            task.cancel()
        self._running.clear()

    async def _start_open(self) -> None:
        for done in [b for b, t in self._running.items() if t.done()]:
            del self._running[done]
        for batch_id in await self._store.open_batches():
            if batch_id not in self._running:
                self._running[batch_id] = asyncio.create_task(self._batch(batch_id),
                                                              name=f"batch-{batch_id}")

    async def _batch(self, batch_id: str) -> None:
        try:
            record = await self._store.get("b", batch_id, None)
            if record is None or record["status"] in ENDED:
                # Ended, but still listed open (its end written, then Redis failed): its
                # place among its owner's open batches is given back now.
                owner = record["_owner"] if record is not None else None
                await self._store.opened(batch_id, owner, False)
                return
            await Batch(self, record).run()
        except asyncio.CancelledError:
            raise
        except StoreUnavailable:
            log.warning("batch %s: the store is unavailable; it resumes later", batch_id)
        except Exception:
            log.exception("batch %s: the runner failed; it resumes later", batch_id)

    async def slot(self) -> None:
        """One of the ``concurrency`` places for a line (``free`` gives it back before
        ``ready``, ``release`` after)."""
        await self._slots.acquire()

    def free(self) -> None:
        self._slots.release()

    def release(self, _: object = None) -> None:
        """A line's place given back (its task ended, however): the slot, and its place in
        the band's share that ``ready`` took."""
        self._slots.release()
        self.share.in_flight -= 1

    async def ready(self, model: object, stop: asyncio.Event) -> bool:
        """Until there is idle capacity for a line of ``model`` (True: its place in the
        band's share is then taken, and ``send`` gives it back) or ``stop`` is set (False).
        One poller per batch: room comes from in-flight counts and scraped loads that
        nothing signals."""
        while not stop.is_set():
            self.share.look(self._queue.interactive_waits, self._queue.pulse.raised)
            if self._room(model if isinstance(model, str) else ""):
                self.share.in_flight += 1
                return True
            await asyncio.sleep(GATE)
        return False

    async def send(self, owner: str, line: Line) -> tuple[int, bytes, str]:
        """One line through the proxy (after ``ready``), as its owner's key in the batch
        band: (status, body, request id)."""
        self.metrics.batch_in_flight.inc()
        try:
            return await self._call(owner, line)
        finally:
            self.metrics.batch_in_flight.dec()

    def _room(self, model: str) -> bool:
        """Capacity nobody interactive waits for: within the band's share, this process's
        queue empty, and one of the model's backends under its capacity, or (none set) vLLM
        queueing nothing."""
        if not self.share.room or not self._queue.idle:
            return False
        candidates = self._pool.candidates(model) if model else []
        if not candidates:
            return True  # the proxy answers it (an unknown model: the line's error)
        return any(b.in_flight < b.capacity if b.capacity
                   else b.load is None or b.load.waiting == 0 for b in candidates)

    async def _call(self, owner: str, line: Line) -> tuple[int, bytes, str]:
        body = orjson.dumps(line.body)
        rid = os.urandom(16).hex()
        keyring = self._tenants()
        key = keyring.owners.get(owner)
        tenant = Tenant(keyring.name_of(owner), key.models if key is not None else frozenset(),
                        BATCH_BAND, owner=owner)
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": line.url,
            "raw_path": line.url.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"x-request-id", rid.encode())],
            "client": ("batch", 0), "server": None, TENANT: tenant}
        sent = False
        status, chunks = 500, []

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # never hangs up
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self._proxy(scope, receive, send)
        return status, b"".join(chunks), rid


class Batch:
    """One batch's run: resumed from its files, cancelled or expired between lines."""

    def __init__(self, runner: Runner, record: dict[str, Any]) -> None:
        self._runner = runner
        self._store = runner.store
        self.record = record
        self.id = record["id"]
        self._out = self._store.path(f"{self.id}.output.jsonl")
        self._err = self._store.path(f"{self.id}.errors.jsonl")
        self._stop = asyncio.Event()
        self._sent = 0  # lines handed to the runner (out of the queued gauge)

    async def run(self) -> None:
        record = self.record
        if record["status"] == "validating":
            record.update(status="in_progress", in_progress_at=now())
            await self._save()
        done, failed = await asyncio.to_thread(results.finished, self._out, self._err)
        source = self._store.path(record["input_file_id"])
        try:
            todo = await asyncio.to_thread(results.todo, source, done)
        except FileNotFoundError:  # deleted since
            record.update(status="failed", failed_at=now(), errors={"object": "list", "data": [
                {"code": "input_file_missing", "message": "The input file was deleted.",
                 "param": "input_file_id", "line": None}]})
            await self._store.put("b", record)
            await self._store.opened(self.id, record["_owner"], False)
            return
        counts = record["request_counts"]  # as the files say (a kill loses the last save)
        counts.update(completed=len(done) - failed, failed=failed)
        if await self._store.cancelled(self.id) or now() >= record["expires_at"]:
            self._stop.set()  # cancelled or expired before this run: no line is sent
        watch = asyncio.create_task(self._watch())
        queued = self._runner.metrics.batch_queued
        queued.inc(len(todo))
        try:
            async with asyncio.TaskGroup() as group:
                for item in todo:
                    if self._stop.is_set():
                        break
                    line = await asyncio.to_thread(results.load, source, item)
                    await self._runner.slot()
                    try:
                        ready = await self._runner.ready(line.body.get("model"), self._stop)
                    except BaseException:
                        self._runner.free()
                        raise
                    if not ready:
                        self._runner.free()
                        break
                    task = group.create_task(self._line(line, counts))
                    task.add_done_callback(self._runner.release)
        finally:
            watch.cancel()
            queued.dec(len(todo) - self._sent)
        await self._finish()

    async def _line(self, line: Line, counts: dict[str, int]) -> None:
        await self._done(line, counts)

    async def _done(self, line: Line, counts: dict[str, int]) -> None:
        self._sent += 1
        self._runner.metrics.batch_queued.dec()
        for attempt in range(RETRIES + 1):  # "not now" (shed, no backend up) is not an answer
            status, body, rid = await self._runner.send(self.record["_owner"], line)
            if status not in RETRIED or attempt == RETRIES or self._stop.is_set():
                break
            await asyncio.sleep(2 ** attempt)
        if not self._runner.leads:
            return  # another runner may run the batch now: it sends this line again
        ok = 200 <= status < 300
        try:
            answer: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            answer = {"error": {"message": "the reply was not JSON", "type": "server_error"}}
        row = orjson.dumps({"id": new_id("batch_req_"), "custom_id": line.custom_id,
                            "response": {"status_code": status, "request_id": rid,
                                         "body": answer},
                            "error": None}) + b"\n"
        await asyncio.to_thread(results.append, self._out if ok else self._err, row)
        counts["completed" if ok else "failed"] += 1
        self._runner.metrics.batch_lines.labels("completed" if ok else "failed").inc()

    async def _watch(self) -> None:
        """Every ``TICK``: the counts saved, a cancel or the window's end noticed (a Redis
        error skips a tick; the lease decides whether the batch goes on)."""
        while True:
            await asyncio.sleep(TICK)
            try:
                saved = not self._runner.leads or await self._save()
            except StoreUnavailable:
                continue
            if not saved or now() >= self.record["expires_at"]:
                self._stop.set()

    async def _save(self) -> bool:
        """Write the record unless the batch was cancelled meanwhile (False then)."""
        if not await self._store.save_running(self.record):
            self.record["status"] = "cancelling"
            return False
        return True

    async def _finish(self) -> None:
        if not self._runner.leads:
            return  # another runner finishes it
        record = self.record
        stored = await self._store.get("b", self.id, None)
        if stored is not None and stored.get("cancelling_at"):
            record["cancelling_at"] = stored["cancelling_at"]
        cancelled = await self._store.cancelled(self.id) or record["status"] == "cancelling"
        if cancelled:
            status = "cancelled"
        elif self._stop.is_set():
            status = "expired"
        else:
            status = "completed"
        record.update(finalizing_at=record.get("finalizing_at") or now())
        for name, field in ((self._out, "output_file_id"), (self._err, "error_file_id")):
            if record.get(field) is None:
                record[field] = await self._register(name)
        record.update(status=status, **{f"{status}_at": now()})
        await self._store.put("b", record)
        await self._store.opened(self.id, record["_owner"], False)
        self._runner.metrics.batches_ended.labels(status).inc()
        log.info("batch %s %s: %s", self.id, status, record["request_counts"])

    async def _register(self, path: Path) -> str | None:
        size = await asyncio.to_thread(results.size, path)
        if not size:
            return None
        await self._store.stored_bytes(self.record["_owner"], size)  # the key's, as uploads
        file_id = new_id("file-")
        await self._store.put("f", {
            "id": file_id, "object": "file", "bytes": size, "created_at": now(),
            "filename": path.name, "purpose": "batch_output", "status": "processed",
            "expires_at": None, "status_details": None,
            "_owner": self.record["_owner"], "_name": path.name}, new=True)
        return file_id

