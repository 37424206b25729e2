"""One backend's KV events, as vLLM 0.32 publishes them (``vllm/distributed/kv_events.py``),
into the index: a ZMQ SUB on its ``endpoint`` (frames ``[topic, seq, payload]``, ``seq``
8 bytes big-endian, from 0 at each start of the instance) and, for gaps, a DEALER on its
``replay_endpoint`` (ask ``[b"", start seq]``; batches come back ``[b"", topic, seq,
payload]`` until ``[b"", b"", END, b""]``).

A feed starts by asking the replay endpoint for everything from seq 0: vLLM keeps its last
``buffer_steps`` batches, so a gateway (re)started beside a running instance learns what it
cached before (all of it while the instance is young), and is ``synced`` once that ends.
What the stream says is applied in order, one batch at a time; what it cannot say is never
guessed: a gap that the replay does not fill (vLLM keeps its last ``buffer_steps`` batches)
or a seq that goes back (the instance restarted) drops the backend's blocks from the index,
and the next events rebuild them. A frame or payload that is not vLLM's is counted and
passed over. The feed only reads: it never slows vLLM's publisher (a PUB socket drops at
its high-water mark rather than wait), and replays are asked only for a gap, from the
first missing seq.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from gateway.kv.events import BadEvents, decode
from gateway.kv.index import Index
from gateway.kv.known import FeedCounts, Heard, Known, in_step

log = logging.getLogger("gateway.kv")

END = b"\xff" * 8  # vLLM's end of a replay (-1 as 8 signed bytes)
MAX_MESSAGE = 64 << 20  # a larger message is refused by ZMQ itself (the peer is cut off)
REPLAY_WITHIN = 2.0  # seconds for a whole replay, else the gap is given up
SYNC_WITHIN = 10.0  # seconds for the first replay (up to vLLM's whole buffer)
class Feed:
    def __init__(self, backend: str, index: Index, endpoint: str, replay: str | None = None,
                 context: zmq.asyncio.Context | None = None,
                 counts: FeedCounts | None = None) -> None:
        self.backend = backend
        self.counts = counts or FeedCounts()
        self._index = index
        self._endpoint = endpoint
        self._replay = replay
        self._context = context or zmq.asyncio.Context.instance()
        self._last: int | None = None  # the seq of the last batch applied
        self._synced_to: int | None = None  # the first replay's last seq: older ones repeat
        self.synced = False  # the first replay is over (or there is none to ask)
        self.lost_at: float | None = None  # monotonic time events were last lost
        self.lag = 0.0  # seconds the last live batch took from vLLM to here

    async def run(self) -> None:
        """Subscribe and apply until cancelled (the control plane runs one per backend)."""
        sub = self._context.socket(zmq.SUB)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self._endpoint)
            await self.sync()
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    await self.lost(sub)
                    continue
                if sub in ready:
                    await self.receive(await sub.recv_multipart())
        finally:
            with contextlib.suppress(zmq.ZMQError):  # the context may be gone already
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close()

    async def lost(self, sub: zmq.asyncio.Socket | None = None) -> None:
        """The publisher went away: the instance stopped or restarted (its seq may even
        pass the last one seen before the subscription is back, which would look like a
        gap), or the connection broke. Its blocks are dropped, and the first replay asked
        again: the new instance's, or the same one's whole buffer. Batches still queued on
        ``sub`` are dropped first (the replay from 0 says whatever they said): read after
        the reset, they would look like a gap."""
        log.info("kv events of %s: the publisher went away; its blocks are dropped",
                 self.backend)
        while sub is not None:
            try:
                await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        self._reset()
        self.synced = False
        await self.sync()

    async def receive(self, frames: list[bytes]) -> None:
        """One message from the SUB socket: applied, or (after a gap) the gap first."""
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, payload = parsed
        if self._synced_to is not None:
            if seq <= self._synced_to:
                return  # published during the first replay, and applied from it
            self._synced_to = None
        if self._last is not None and seq <= self._last:
            log.info("kv events of %s start again at %d: its blocks are dropped",
                     self.backend, seq)
            self._reset()
        elif self._last is not None and seq > self._last + 1:
            self.counts.gaps += 1
            if not await self._fill(self._last + 1, seq):
                log.warning("kv events of %s: batches %d to %d lost; its blocks are dropped",
                            self.backend, self._last + 1, seq - 1)
                self._reset()
                self.lost_at = time.monotonic()
        self._apply(seq, payload, live=True)

    def _parse(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts.bad += 1
            return None
        return int.from_bytes(frames[1], "big"), frames[2]

    async def sync(self) -> None:
        """Everything the replay endpoint still holds, from seq 0, applied in order."""
        if self._replay is not None:
            try:
                async with asyncio.timeout(SYNC_WITHIN):
                    await self._ask(0, None)
            except (TimeoutError, zmq.ZMQError) as exc:
                log.info("kv events of %s: the first replay did not finish (%s)",
                         self.backend, type(exc).__name__)
            self._synced_to = self._last
        self.synced = True

    def _apply(self, seq: int, payload: bytes, live: bool = False) -> None:
        try:
            batch = decode(payload)
        except BadEvents as exc:
            self.counts.bad += 1
            log.warning("kv events of %s: batch %d passed over: %s", self.backend, seq,
                        str(exc)[:200])
        else:
            self._index.apply(self.backend, batch)
            self.counts.batches += 1
            self.counts.last_event = time.monotonic()
            if live:
                self.lag = max(0.0, time.time() - batch.ts)
        self._last = seq

    def _reset(self) -> None:
        self.counts.resets += 1
        self._index.drop(self.backend)
        self._last = None

    async def _fill(self, first: int, upto: int) -> bool:
        """Batches ``first`` .. ``upto - 1`` from the replay endpoint, applied in order;
        False when it has none, answers too late or no longer holds ``first``."""
        if self._replay is None:
            return False
        try:
            async with asyncio.timeout(REPLAY_WITHIN):
                return await self._ask(first, upto)
        except (TimeoutError, zmq.ZMQError):
            return False

    async def _ask(self, first: int, upto: int | None) -> bool:
        """Ask the replay endpoint from ``first`` and apply what comes, up to ``upto``
        (None: to its end, starting wherever its buffer starts)."""
        assert self._replay is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay)
        try:
            await dealer.send_multipart([b"", first.to_bytes(8, "big")])
            return await self._replayed(dealer, first, upto)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close()

    async def _replayed(self, dealer: zmq.asyncio.Socket, want: int, upto: int | None) -> bool:
        while upto is None or want < upto:
            frames = await dealer.recv_multipart()
            if len(frames) == 4 and frames[2] == END:
                return upto is None  # the end: of the buffer, or before the gap was filled
            if len(frames) != 4 or len(frames[2]) != 8:
                self.counts.bad += 1
                return False
            seq = int.from_bytes(frames[2], "big")
            if seq < want:
                continue
            if seq > want and upto is not None:
                return False  # it no longer holds ``want``
            self._apply(seq, frames[3])
            self.counts.replayed += 1
            want = seq + 1
        return True


class Feeds(Known):
    """A feed for every backend that publishes events, kept in step with the backends
    there are (a reload or a discovery adds and removes them): ``run`` looks every
    ``every`` seconds."""

    def __init__(self, index: Index, every: float = 1.0, processes: int = 1) -> None:
        super().__init__(index, processes)
        self.feeds: dict[str, Feed] = {}
        self._counts: dict[str, FeedCounts] = {}  # per backend, across its feeds
        self._tasks: dict[str, tuple[tuple[str, str | None], asyncio.Task[None]]] = {}
        self._every = every

    def align(self, wanted: dict[str, tuple[str, str | None]]) -> None:
        """Start a feed per new backend (or new endpoints), stop those no longer wanted."""
        for name, (endpoints, task) in list(self._tasks.items()):
            if task.done() and not task.cancelled():  # it failed: said, then started again
                log.error("kv events of %s: the feed stopped (%s); its blocks are dropped",
                          name, task.exception())
            if wanted.get(name) != endpoints or task.done():
                task.cancel()
                del self._tasks[name]
                self.feeds.pop(name, None)
                self._counts[name].resets += 1
                self.index.drop(name)
                self.checks.drop(name)
        for name, endpoints in wanted.items():
            if name not in self._tasks:
                feed = Feed(name, self.index, endpoints[0], endpoints[1],
                            counts=self._counts.setdefault(name, FeedCounts()))
                self.feeds[name] = feed
                self._tasks[name] = (endpoints, asyncio.get_running_loop().create_task(
                    feed.run(), name=f"kv-feed-{name}"))

    def heard(self) -> dict[str, Heard]:
        return {name: _heard(feed) for name, feed in self.feeds.items()}

    def heard_of(self, backend: str) -> Heard | None:
        feed = self.feeds.get(backend)
        return _heard(feed) if feed is not None else None

    async def run(self, wanted: Callable[[], dict[str, tuple[str, str | None]]]) -> None:
        try:
            while True:
                self.align(wanted())
                await asyncio.sleep(self._every)
        finally:
            tasks = [task for _, task in self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _heard(feed: Feed) -> Heard:
    return Heard(in_step(feed.synced, feed.lost_at), feed.lag, feed.counts)
