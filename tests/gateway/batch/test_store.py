"""The batch store's count of a key's open batches, against a real valkey-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.batch.store import Store
from gateway.metrics import Metrics
from gateway.state.link import RedisLink
from tests.gateway.state.test_link import client_for
from tests.helpers import RedisServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path)
    yield s
    s.stop()


def record(n: int, owner: str) -> dict[str, object]:
    return {"id": f"batch_{n:024x}", "_owner": owner, "created_at": 1}


def test_creates_at_once_never_pass_the_limit(server: RedisServer, tmp_path: Path) -> None:
    """Forty creates of one key at once (a key allowed 3 open batches): at most 3 written
    and counted, and those refused leave no trace (no record, no count); later ones fill
    the room left."""
    async def main() -> None:
        link = RedisLink(client_for(server), "t:", 1.0, Metrics())
        store = Store(link, str(tmp_path))
        got = await asyncio.gather(*(store.create(record(i, "alice"), 3) for i in range(40)))
        held = await store.open_batches("alice")
        assert sum(got) <= 3 and len(held) == sum(got)
        assert sorted(f"batch_{i:024x}" for i, ok in enumerate(got) if ok) == held
        assert sorted(r["id"] for r in await store.open_records()) == held
        assert [await store.get("b", f"batch_{i:024x}", None) is not None
                for i in range(40)] == [bool(ok) for ok in got]
        n = sum(got)
        while n < 3:
            n += await store.create(record(100 + n, "alice"), 3)
        assert not await store.create(record(200, "alice"), 3)
        assert await store.get("b", f"batch_{200:024x}", None) is None
        assert await store.create(record(300, "bob"), 3)  # each key its own count
        await link.aclose()
    asyncio.run(main())


def test_a_filtered_listing_pages_through_every_match(server: RedisServer,
                                                      tmp_path: Path) -> None:
    """Files of two purposes, listed by one of them two at a time: each page is full while
    more follow, and paging by the last id finds every match once, newest first."""
    async def main() -> None:
        link = RedisLink(client_for(server), "t:", 1.0, Metrics())
        store = Store(link, str(tmp_path))
        for i in range(12):  # mostly outputs, as after a few batches
            await store.put("f", {"id": f"file-{i:024x}", "_owner": "alice", "created_at": i,
                                  "purpose": "batch" if i % 4 == 0 else "batch_output"},
                            new=True)
        seen, after, more = [], None, True

        def keep(record: dict[str, object]) -> bool:
            return record["purpose"] == "batch"

        while more:
            page, more = await store.listed("f", "alice", 2, after, keep)
            assert len(page) == 2 or not more
            seen += [r["id"] for r in page]
            after = page[-1]["id"] if page else None
        assert seen == [f"file-{i:024x}" for i in (8, 4, 0)]
        everything, more = await store.listed("f", "alice", 5, None)
        assert len(everything) == 5 and more
        await link.aclose()
    asyncio.run(main())


def test_an_ended_batch_still_listed_open_gives_its_owners_count_back(
        server: RedisServer, tmp_path: Path) -> None:
    """A batch whose end was written but whose removal from the open sets was not (Redis
    failed between the two): the runner's next look removes it from its owner's count
    too, so the key can open batches again."""
    from gateway.batch.runner import Runner

    async def main() -> None:
        link = RedisLink(client_for(server), "t:", 1.0, Metrics())
        store = Store(link, str(tmp_path))
        ended = record(1, "alice")
        assert await store.create(ended, 1)
        await store.put("b", {**ended, "status": "completed"})  # its end, and no removal
        assert not await store.create(record(2, "alice"), 1)
        runner = Runner.__new__(Runner)
        runner._store = store
        await runner._batch(ended["id"])  # type: ignore[arg-type]
        assert await store.open_batches("alice") == [] and await store.open_batches() == []
        assert await store.create(record(2, "alice"), 1)
        await link.aclose()
    asyncio.run(main())


def test_the_store_still_asks_while_the_link_counts_as_down(server: RedisServer,
                                                            tmp_path: Path) -> None:
    """A late answer elsewhere marks the link down for its retry interval (an hour here):
    the store's calls still go to Redis, instead of answering 503 until then."""
    async def main() -> None:
        link = RedisLink(client_for(server), "t:", 3600, Metrics())
        store = Store(link, str(tmp_path))
        assert await store.create(record(1, "alice"), 3)
        link._failed(TimeoutError("late"))  # as the link marks itself after a late answer
        assert not link.available
        assert (await store.get("b", f"batch_{1:024x}", None) or {}).get("_owner") == "alice"
        assert await store.open_batches("alice") == [f"batch_{1:024x}"]
        await link.aclose()
    asyncio.run(main())
