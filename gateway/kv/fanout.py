"""The control process's KV index, followed by its serving workers without decoding vLLM's
events again. Each worker decoding every batch of every instance cost 2.3 times the
default's CPU per request with 8 workers on the H100 (issue 38): the decoding and hashing
scale with the workers, what the index holds does not.

The control process follows every instance's events (``gateway.kv.feed.Feeds``), and its
index notes which keys changed holders (``gateway.kv.index.Journal``). ``Publisher`` sends
those changes, coalesced over FLUSH_AFTER and numbered, on a PUB socket
(``ipc://DIR/changes``); each worker's ``Mirror`` applies them in order to its own index,
which its request path reads as one process's own. A worker that starts, or misses a number
(its socket dropped messages at the high-water mark, or it subscribed late), asks for the
whole index (``ipc://DIR/copy``, a ROUTER) and goes on from the number the copy was taken
at; a change it already has is applied again harmlessly (each says what holds now). What
the events say of each backend (in step, lag, counts) comes every STATUS_EVERY; a worker
that hears nothing for STALE, or is out of step, routes every backend by the estimate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway.kv.feed import Feeds
from gateway.kv.index import KEY_BYTES, Index, Journal
from gateway.kv.known import FeedCounts, Heard, Known
from gateway.kv.pending import FILE, Pending, create

log = logging.getLogger("gateway.kv")

Wanted = Callable[[], dict[str, tuple[str, str | None]]]

CHANGES, STATUS = b"c", b"s"
FLUSH_AFTER = 0.002  # seconds: the changes of batches that come this close go as one
STATUS_EVERY = 0.5
STALE = 3.0  # seconds without a status: the control process is not heard
COPY_WITHIN = 2.0
HWM = 100_000  # messages queued per worker before the PUB socket drops (a copy follows)
COPY_CHUNK = 20_000  # keys of a whole copy applied between two turns of the event loop


def _status(feeds: Known) -> dict[str, list[Any]]:
    return {name: [h.in_step, h.lag, h.counts.batches, h.counts.bad, h.counts.gaps,
                   h.counts.replayed, h.counts.resets, h.counts.last_event]
            for name, h in feeds.heard().items()}


def _heard(raw: dict[str, list[Any]]) -> dict[str, Heard]:
    return {name: Heard(bool(v[0]), float(v[1]), FeedCounts(*v[2:8]))
            for name, v in raw.items()}


class Publisher:
    """The control process's side: its feeds, their index's changes sent to the workers,
    and a copy of the whole index for a worker that asks."""

    def __init__(self, feeds: Feeds, directory: str | None = None, processes: int = 1) -> None:
        self.feeds = feeds
        self.directory = directory or tempfile.mkdtemp(prefix="vgw-kv-")
        create(os.path.join(self.directory, FILE), processes)  # each worker's pending prefill
        self._changed = asyncio.Event()
        feeds.index.journal = Journal(wake=self._changed.set)
        self._seq = 0

    async def run(self, wanted: Wanted) -> None:
        context = zmq.asyncio.Context.instance()
        pub, copy = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
        tasks: list[asyncio.Task[None]] = []
        try:
            for socket in (pub, copy):
                socket.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, HWM)
            pub.bind(f"ipc://{self.directory}/changes")
            copy.bind(f"ipc://{self.directory}/copy")
            tasks = [asyncio.create_task(self.feeds.run(wanted), name="kv-feeds"),
                     asyncio.create_task(self._answer(copy), name="kv-copies")]
            await self._publish(pub)
        except Exception:  # the workers then route every backend by the estimate
            log.exception("kv index: no longer published to the workers")
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pub.close()
            copy.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    async def _publish(self, pub: zmq.asyncio.Socket) -> None:
        said = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STATUS_EVERY):
                    await self._changed.wait()
                await asyncio.sleep(FLUSH_AFTER)
            self._changed.clear()
            changes = self.feeds.index.changes()
            if changes:
                self._seq += 1
                await pub.send_multipart([CHANGES, self._seq.to_bytes(8, "big"),
                                          msgspec.msgpack.encode(changes)])
            if time.monotonic() - said >= STATUS_EVERY:
                said = time.monotonic()
                await pub.send_multipart([STATUS, self._seq.to_bytes(8, "big"),
                                          msgspec.msgpack.encode(_status(self.feeds))])

    async def _answer(self, copy: zmq.asyncio.Socket) -> None:
        while True:
            frames = await copy.recv_multipart()
            whole = {"index": self.feeds.index.contents(), "heard": _status(self.feeds)}
            await copy.send_multipart([frames[0], self._seq.to_bytes(8, "big"),
                                       msgspec.msgpack.encode(whole)])


def _pending(directory: str, slot: int | None) -> Pending | None:
    """The workers' prefill added up in the control process's map; without it (a worker
    started by hand, a map that cannot be read) each counts its own times ``processes``."""
    if slot is None:
        return None
    try:
        return Pending(os.path.join(directory, FILE), slot)
    except (OSError, ValueError) as exc:
        log.warning("kv: pending prefill not shared with the other workers: %s", exc)
        return None


class Mirror(Known):
    """A serving worker's side: a copy of the control process's index, kept in step."""

    def __init__(self, index: Index, directory: str, processes: int = 1,
                 slot: int | None = None) -> None:
        super().__init__(index, processes, _pending(directory, slot))
        self._directory = directory
        self._heard: dict[str, Heard] = {}
        self._heard_at = 0.0  # monotonic time of the last status
        self._seq: int | None = None  # the last change applied; None: out of step
        self.copies = 0  # whole copies taken: at the start, and after a number was missed
        self.bad = 0  # messages that could not be read (a copy follows)

    def heard(self) -> dict[str, Heard]:
        return {name: self._trusted(h) for name, h in self._heard.items()}

    def heard_of(self, backend: str) -> Heard | None:
        heard = self._heard.get(backend)
        return self._trusted(heard) if heard is not None else None

    def _trusted(self, heard: Heard) -> Heard:
        """Out of step, or the control process not heard lately: not in step."""
        if heard.in_step and (self._seq is None
                              or time.monotonic() - self._heard_at > STALE):
            return Heard(False, heard.lag, heard.counts)
        return heard

    async def run(self, wanted: Wanted | None = None) -> None:
        """Follow until cancelled (``wanted`` is the control process's to use). The changes
        are read off a plain socket when its descriptor wakes the loop, every message
        waiting at once: pyzmq's asyncio socket makes futures and callbacks per message,
        in each of the workers. Out of step, the socket is left unread (its messages
        wait) until a whole copy is taken."""
        context = zmq.asyncio.Context.instance()
        sub = zmq.Socket(context, zmq.SUB)
        loop = asyncio.get_running_loop()
        lost = asyncio.Event()
        fd = sub.fileno()

        def drain() -> None:
            while self._seq is not None:
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return  # the descriptor wakes the loop again when more comes
                self.receive(frames)
            loop.remove_reader(fd)
            lost.set()

        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, HWM)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{self._directory}/changes")
            while True:
                if self._seq is None:
                    await self._copy(context)
                    continue
                lost.clear()
                loop.add_reader(fd, drain)
                drain()  # what came while unwatched: the descriptor only tells of news
                await lost.wait()
        finally:
            loop.remove_reader(fd)
            sub.close()

    def receive(self, frames: list[bytes]) -> None:
        """One message: changes applied in order (a number missed: out of step), or the
        feeds' status."""
        try:
            kind, seq, payload = frames[0], int.from_bytes(frames[1], "big"), frames[2]
            if kind == STATUS:
                self._hear(msgspec.msgpack.decode(payload))
                if self._seq is not None and seq > self._seq:  # changes missed, none since
                    log.info("kv index copy: changes to %d missed; asking for the whole "
                             "index", seq)
                    self._seq = None
            elif self._seq is not None and seq == self._seq + 1:
                self.index.follow(msgspec.msgpack.decode(payload))
                self._seq = seq
            elif self._seq is not None and seq > self._seq:
                log.info("kv index copy: changes %d to %d missed; asking for the whole index",
                         self._seq + 1, seq - 1)
                self._seq = None
        except (IndexError, ValueError, TypeError, msgspec.DecodeError):
            self.bad += 1
            self._seq = None

    def _hear(self, raw: dict[str, list[Any]]) -> None:
        heard = _heard(raw)
        for gone in self._heard.keys() - heard.keys():
            self.checks.drop(gone)
        self._heard, self._heard_at = heard, time.monotonic()

    async def _copy(self, context: zmq.asyncio.Context) -> None:
        """The whole index from the control process, then the changes after it."""
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(f"ipc://{self._directory}/copy")
            await dealer.send(b"copy")
            async with asyncio.timeout(COPY_WITHIN):
                frames = await dealer.recv_multipart()
            whole = msgspec.msgpack.decode(frames[1])
        except (TimeoutError, zmq.ZMQError, IndexError, msgspec.DecodeError):
            await asyncio.sleep(0.2)  # the control process is starting, or busy: again
            return
        finally:
            dealer.close()
        for backend in self.index.backends():
            self.index.drop(backend)
        step = COPY_CHUNK * KEY_BYTES
        for name, (size, keys) in whole["index"].items():  # in parts: requests go on
            for at in range(0, max(1, len(keys)), step):
                self.index.follow({name: (False, size, keys[at:at + step], b"")})
                await asyncio.sleep(0)
        self._hear(whole["heard"])
        self._seq = int.from_bytes(frames[0], "big")
        self.copies += 1
