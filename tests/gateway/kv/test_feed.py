"""A backend's KV event feed against a publisher that sends and replays as vLLM 0.32's
does (``tests/gateway/kv/wire.py``): batches applied in order, gaps filled from the
replay or the backend's blocks dropped, a restart noticed, bad frames passed over, and a
burst drained over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from gateway.kv.events import decode
from gateway.kv.feed import Feed, Feeds
from gateway.kv.index import Index, keys
from tests.gateway.kv.wire import SIZE, TOKENS, Publisher, encode, recorded, stored


def run(test: Callable[[zmq.asyncio.Context], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        try:
            await asyncio.wait_for(test(context), 20)
        finally:
            context.destroy(linger=0)
    asyncio.run(main())


def chain(n: int) -> list[bytes]:
    """``n`` batches of one block each, every block the child of the one before."""
    return [encode([stored([i + 1], [i, i, i, i], parent=i or None)]) for i in range(n)]


def held(index: Index, n: int) -> int:
    """How many leading blocks of ``chain(n)``'s prompt backend "a" holds."""
    return index.match(keys([t for i in range(n) for t in (i, i, i, i)], 4)).get("a", 0)


def test_batches_are_applied_in_order() -> None:
    async def test(context: zmq.asyncio.Context) -> None:
        publisher, index = Publisher(context), Index()
        feed = Feed("a", index, publisher.endpoint, publisher.replay, context)
        for payload in (recorded(0), recorded(4), recorded(5)):
            await feed.receive(publisher.batch(payload))
        assert index.match(keys(TOKENS["completion_a"], SIZE)) == {"a": 6}
        assert feed.counts.batches == 3 and feed.counts.gaps == feed.counts.bad == 0
        await publisher.close()
    run(test)


def test_a_gap_is_filled_from_the_replay_in_order() -> None:
    async def test(context: zmq.asyncio.Context) -> None:
        publisher, index = Publisher(context), Index()
        feed = Feed("a", index, publisher.endpoint, publisher.replay, context)
        frames = [publisher.batch(p) for p in chain(6)]
        await feed.receive(frames[0])
        await feed.receive(frames[4])  # 1, 2 and 3 lost on the way
        await feed.receive(frames[5])
        assert (feed.counts.gaps, feed.counts.replayed, feed.counts.resets) == (1, 3, 0)
        assert held(index, 6) == 6 and index.counts.orphans == 0
        await publisher.close()
    run(test)


def test_a_gap_the_replay_no_longer_holds_drops_the_backends_blocks() -> None:
    async def test(context: zmq.asyncio.Context) -> None:
        publisher, index = Publisher(context, keep=2), Index()
        feed = Feed("a", index, publisher.endpoint, publisher.replay, context)
        frames = [publisher.batch(p) for p in chain(6)]
        await feed.receive(frames[0])
        await feed.receive(frames[5])  # 1 to 4 lost, and the replay keeps only 4 and 5
        assert (feed.counts.gaps, feed.counts.resets) == (1, 1)
        assert held(index, 6) == 0  # nothing guessed: block 0 went with the reset
        assert index.counts.orphans == 1  # 5's parent is unknown now
        other = Feed("b", index, publisher.endpoint, None, context)  # no replay endpoint
        await other.receive(frames[0])
        await other.receive(frames[2])
        assert other.counts.resets == 1
        await publisher.close()
    run(test)


def test_a_restarted_instance_starts_again_from_nothing() -> None:
    async def test(context: zmq.asyncio.Context) -> None:
        publisher, index = Publisher(context), Index()
        feed = Feed("a", index, publisher.endpoint, publisher.replay, context)
        for payload in chain(3):
            await feed.receive(publisher.batch(payload))
        assert held(index, 3) == 3
        restarted = Publisher(context)  # its seq starts at 0 again
        await feed.receive(restarted.batch(recorded(0)))
        assert feed.counts.resets == 1 and held(index, 3) == 0
        assert index.match(keys(TOKENS["completion_a"], SIZE)) == {"a": 6}
        await publisher.close()
        await restarted.close()
    run(test)


def test_a_publisher_that_goes_away_is_a_restart_even_when_its_seq_runs_ahead() -> None:
    """The instance restarts on the same endpoints and publishes more batches before the
    subscription is back than it had before: the seq says "a gap", but the feed saw the
    connection go, dropped the old blocks and asked the new instance's replay from 0."""
    async def test(context: zmq.asyncio.Context) -> None:
        publisher, index = Publisher(context), Index()
        feed = Feed("a", index, publisher.endpoint, publisher.replay, context)
        task = asyncio.create_task(feed.run())
        for payload in chain(3):
            await publisher.send(payload)
        await until(lambda: held(index, 3) == 3, 10)
        await publisher.close()
        await until(lambda: feed.counts.resets == 1, 10)
        replayed, batches = feed.counts.replayed, feed.counts.batches
        restarted = Publisher(context, on=publisher)  # its seq starts at 0 again
        for payload in (encode([stored([100 + i], [9, 9, 9, i])]) for i in range(5)):
            restarted.batch(payload)  # sent before the feed was back: only in the replay
        await until(lambda: feed.synced and feed.counts.replayed == replayed + 5, 10)
        await restarted.send(recorded(0))  # seq 5, one past the replay's last: no gap
        await until(lambda: feed.counts.batches == batches + 5 + 1, 10)
        assert held(index, 3) == 0 and feed.counts.resets == 1 and feed.counts.gaps == 0
        assert index.match(keys([9, 9, 9, 4], 4)) == {"a": 1}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await restarted.close()
    run(test)


def test_frames_that_are_not_vllms_are_passed_over() -> None:
    async def test(context: zmq.asyncio.Context) -> None:
        publisher, index = Publisher(context), Index()
        feed = Feed("a", index, publisher.endpoint, publisher.replay, context)
        await feed.receive([b"kv", b"\x00" * 8])  # a frame short
        await feed.receive([b"kv", b"\x01", b"x"])  # a seq that is not 8 bytes
        await feed.receive(publisher.batch(b"\xc1garbage"))
        await feed.receive(publisher.batch(recorded(0)))
        assert feed.counts.bad == 3 and feed.counts.batches == 1 and feed.counts.gaps == 0
        assert index.match(keys(TOKENS["completion_a"], SIZE)) == {"a": 6}
        await publisher.close()
    run(test)


BURST = 5_000


def test_a_burst_over_zmq_is_drained_whole() -> None:
    """Every batch of a burst sent as fast as the PUB socket takes them is applied (none
    dropped at the high-water mark, none out of order): the feed keeps up."""
    async def test(context: zmq.asyncio.Context) -> None:
        publisher, index = Publisher(context), Index()
        feed = Feed("a", index, publisher.endpoint, publisher.replay, context)
        task = asyncio.create_task(feed.run())
        warm = encode([{"type": "AllBlocksCleared"}])
        await until(lambda: feed.counts.batches > 0, 10,  # the subscription is through
                    lambda: publisher.send(warm))
        await publisher.send(warm)
        base = feed.counts.batches
        for payload in chain(BURST):
            await publisher.send(payload)
        await until(lambda: held(index, BURST) == BURST, 15)
        assert feed.counts.batches >= base + BURST and feed.counts.bad == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.close()
    run(test)


async def until(condition: Callable[[], bool], within: float,
                meanwhile: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        if meanwhile is not None:
            await meanwhile()
        await asyncio.sleep(0.01)


def test_feeds_follow_the_backends_there_are() -> None:
    """A reload that removes a backend (or moves its endpoints) stops its feed and forgets
    its blocks, counted as a reset that outlives the feed (a backend that leaves the ready
    ones and comes back gets a new feed, and its counts go on); a new one gets a feed."""
    async def test(context: zmq.asyncio.Context) -> None:
        feeds = Feeds(Index())
        feeds.align({"a": ("ipc:///nowhere/a", None), "b": ("ipc:///nowhere/b", None)})
        assert sorted(feeds.feeds) == ["a", "b"]
        feeds.index.apply("a", decode(recorded(0)))
        feeds.feeds["a"].counts.gaps = 3
        feeds.align({"a": ("ipc:///nowhere/a2", None), "c": ("ipc:///nowhere/c", None)})
        assert sorted(feeds.feeds) == ["a", "c"] and feeds.index.blocks("a") == 0
        assert (feeds.feeds["a"].counts.resets, feeds.feeds["a"].counts.gaps) == (1, 3)
        assert feeds.feeds["c"].counts.resets == 0
        runner = asyncio.create_task(feeds.run(dict))  # nothing wanted: every feed stops
        await until(lambda: not feeds.feeds, 5)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    run(test)


def test_a_feed_started_beside_a_running_instance_learns_its_cache_from_the_replay() -> None:
    """The gateway (re)starts while vLLM already cached prompts: the first replay, from
    seq 0, rebuilds what it holds; batches published during it are not applied twice and
    do not look like a restart."""
    async def test(context: zmq.asyncio.Context) -> None:
        publisher, index = Publisher(context), Index()
        feed = Feed("a", index, publisher.endpoint, publisher.replay, context)
        frames = [publisher.batch(p) for p in chain(4)]  # sent before the gateway was there
        assert not feed.synced
        await feed.sync()
        assert feed.synced and held(index, 4) == 4 and feed.counts.replayed == 4
        await feed.receive(frames[3])  # the last one again, live: already applied
        more = [publisher.batch(p) for p in chain(6)[4:]]
        for frame in more:
            await feed.receive(frame)
        assert held(index, 6) == 6 and feed.counts.resets == feed.counts.gaps == 0
        bare = Feed("b", index, publisher.endpoint, None, context)  # nothing to ask
        await bare.sync()
        assert bare.synced and index.blocks("b") == 0
        await publisher.close()
    run(test)


def test_each_backends_standing_says_whether_its_index_can_be_trusted() -> None:
    async def test(context: zmq.asyncio.Context) -> None:
        publisher = Publisher(context)
        feeds = Feeds(Index())
        feed = feeds.feeds["a"] = Feed("a", feeds.index, publisher.endpoint, None, context)
        assert feeds.standing("b") == "estimated"  # no events at all
        assert feeds.standing("a") == "unsynced"  # not yet in step
        await feed.sync()
        assert feeds.standing("a") == "exact"
        now = time.time()
        await feed.receive(publisher.batch(encode([stored([1], [1, 2, 3, 4])], ts=now - 5)))
        assert feeds.standing("a") == "lagging"  # sent 5 s before it arrived
        await feed.receive(publisher.batch(encode([stored([2], [5, 6, 7, 8], 1)], ts=now)))
        assert feeds.standing("a") == "exact"
        later = encode([stored([3], [9, 9, 9, 9])], ts=time.time())
        await feed.receive([b"kv", (9).to_bytes(8, "big"), later])  # 2 to 8 lost
        assert feeds.standing("a") == "unsynced"  # for a while: the estimate meanwhile
        feed.lost_at = None
        for _ in range(10):
            feeds.checks.record("a", False)
        assert feeds.standing("a") == "inexact"
        await publisher.close()
    run(test)
