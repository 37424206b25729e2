"""The control process's KV index copied by its workers (``gateway.kv.fanout``): the
journal's changes make a copy that answers as the index does, over real ZMQ sockets, with a
whole copy for a worker that starts late or misses a number, and the feeds' standing
carried along (and withdrawn when the control process is not heard)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from gateway.kv import fanout
from gateway.kv.events import decode
from gateway.kv.fanout import Mirror, Publisher
from gateway.kv.feed import Feed, Feeds
from gateway.kv.index import Index, Journal, keys
from tests.gateway.kv.test_feed import until
from tests.gateway.kv.wire import encode, stored

BACKENDS = ("a", "b", "c")


def prompt(n: int, blocks: int) -> list[int]:
    """Prompt ``n``'s first ``blocks`` blocks of 4 tokens: prompts share their first
    blocks by ``n`` modulo 3, so prefixes overlap."""
    return [n % 3 if i < 8 else n for i in range(blocks * 4)]


class Workload:
    """Random stores, evictions, clears and drops on an index, as vLLM's events say them."""

    def __init__(self, index: Index, seed: int) -> None:
        self.index, self.rng = index, random.Random(seed)
        self.hash = 0
        self.by_backend: dict[str, list[int]] = {b: [] for b in BACKENDS}

    def step(self) -> None:
        backend, roll = self.rng.choice(BACKENDS), self.rng.random()
        mine = self.by_backend[backend]
        if roll < 0.6:
            blocks = self.rng.randint(1, 6)
            hashes = list(range(self.hash + 1, self.hash + blocks + 1))
            self.hash += blocks
            event = stored(hashes, prompt(self.rng.randint(0, 20), blocks))
            mine.extend(hashes)
            self.index.apply(backend, decode(encode([event])))
        elif roll < 0.9 and mine:
            gone = self.rng.sample(mine, min(len(mine), self.rng.randint(1, 4)))
            for h in gone:
                mine.remove(h)
            self.index.apply(backend, decode(encode(
                [{"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"}])))
        elif roll < 0.95:
            mine.clear()
            self.index.apply(backend, decode(encode([{"type": "AllBlocksCleared"}])))
        else:
            mine.clear()
            self.index.drop(backend)


def answers(index: Index) -> list[dict[str, int]]:
    return [index.match(keys(prompt(n, 6), 4)) for n in range(21)] + \
        [index.blocks(b) for b in BACKENDS]  # type: ignore[list-item]


@pytest.mark.parametrize("seed", range(5))
def test_a_copy_that_follows_the_changes_answers_as_the_index_does(seed: int) -> None:
    index, copy = Index(), Index()
    index.journal = Journal()
    work = Workload(index, seed)
    for step in range(400):
        work.step()
        if step % 7 == 0:  # changes of several batches at once, as FLUSH_AFTER gathers them
            copy.follow(index.changes())
            assert answers(copy) == answers(index)
    copy.follow(index.changes())
    assert answers(copy) == answers(index)
    assert any(answers(index)[:21])  # the workload left something to find


def test_changes_applied_twice_change_nothing() -> None:
    """A worker's whole copy may already hold changes published after it: applied again,
    they leave it as it was."""
    index, copy = Index(), Index()
    index.journal = Journal()
    work = Workload(index, 7)
    for _ in range(100):
        work.step()
    whole = index.contents()
    for _ in range(50):
        work.step()
    changes = index.changes()
    copy.follow({name: (True, size, packed, b"") for name, (size, packed) in whole.items()})
    copy.follow(index.changes() | changes)
    copy.follow(changes)
    assert answers(copy) == answers(index)


def test_a_store_told_again_clears_a_copys_stale_mark() -> None:
    """A worker's reply said backend "a" lacked a block its copy thought it held (a stale
    mark, the worker's own); vLLM then tells the same store again (a replay, or a removal
    the feed missed). The control index changes nothing, but its journal names the block,
    so the copy sees "a" hold it again."""
    index, copy = Index(), Index()
    index.journal = Journal()
    tokens = prompt(1, 3)
    event = decode(encode([stored([1, 2, 3], tokens)]))
    index.apply("a", event)
    copy.follow(index.changes())
    wanted = keys(tokens, 4)
    assert copy.match(wanted) == {"a": 3}
    copy.found("a", wanted, 1)  # the reply: only the first block was cached
    assert copy.match(wanted) == {"a": 1}
    index.apply("a", event)  # told again, unchanged for the index
    copy.follow(index.changes())
    assert copy.match(wanted) == index.match(wanted) == {"a": 3}


def run(test: asyncio.coroutines.Coroutine[object, object, None]) -> None:
    asyncio.run(asyncio.wait_for(test, 30))


def test_workers_copy_the_control_index_over_zmq(tmp_path: Path) -> None:
    """A worker started after the control's index was filled takes a whole copy, then
    follows the changes; one that misses a number takes a copy again."""
    async def test() -> None:
        feeds = Feeds(Index())
        publisher = Publisher(feeds, str(tmp_path))
        work = Workload(feeds.index, 3)
        for _ in range(200):
            work.step()
        control = asyncio.create_task(publisher.run(dict))
        early, late = Mirror(Index(), str(tmp_path)), Mirror(Index(), str(tmp_path))
        tasks = [asyncio.create_task(early.run())]
        await until(lambda: early.copies == 1, 10)
        tasks.append(asyncio.create_task(late.run()))
        for _ in range(300):
            work.step()
            await asyncio.sleep(0)
        await until(lambda: answers(late.index) == answers(early.index) == answers(feeds.index),
                    10)
        publisher._seq += 1  # a number no worker sees: each takes a whole copy again
        work.step()
        await until(lambda: early.copies == 2 and late.copies == 2, 10)
        await until(lambda: answers(late.index) == answers(feeds.index), 10)
        publisher._seq += 1  # missed, and no change follows: the status says so
        await until(lambda: early.copies == 3 and late.copies == 3, 10)
        for task in (*tasks, control):
            task.cancel()
        await asyncio.gather(*tasks, control, return_exceptions=True)
    run(test())
    assert not tmp_path.exists()  # the sockets' directory is removed


def test_a_workers_standing_is_the_controls_until_the_control_is_not_heard(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "STATUS_EVERY", 0.05)
    monkeypatch.setattr(fanout, "STALE", 0.5)

    async def test() -> None:
        feeds = Feeds(Index())
        feeds.feeds["a"] = feed = Feed("a", feeds.index, "ipc:///nowhere")
        publisher = Publisher(feeds, str(tmp_path))
        control = asyncio.create_task(publisher.run(dict))
        worker = Mirror(Index(), str(tmp_path))
        task = asyncio.create_task(worker.run())
        await until(lambda: worker.standing("a") == "unsynced", 10)  # its first replay runs
        assert worker.standing("b") == "estimated"  # no events: by the estimate
        feed.synced = True
        feed.counts.gaps = 2
        await until(lambda: worker.standing("a") == "exact", 10)
        assert worker.heard()["a"].counts.gaps == 2
        feed.lag = 5.0
        await until(lambda: worker.standing("a") == "lagging", 10)
        feed.lag = 0.0
        await until(lambda: worker.standing("a") == "exact", 10)
        control.cancel()  # the control process is gone: its word is withdrawn
        await asyncio.gather(control, return_exceptions=True)
        await until(lambda: worker.standing("a") == "unsynced", 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    run(test())
