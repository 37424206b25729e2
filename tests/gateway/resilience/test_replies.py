"""Which requests the reply cache keeps, and under which key."""

from __future__ import annotations

import asyncio

import orjson

from gateway.config import DegradedSection
from gateway.resilience.replies import ReplyCache, cache_key
from gateway.types import Request
from tests import factories

MESSAGES = [{"role": "user", "content": "hi"}]


def ctx(path: str = "/v1/chat/completions", **payload: object) -> Request:
    body = {"model": "m", "messages": MESSAGES, **payload}
    return factories.request(path=path, stream=bool(payload.get("stream")),
                         body=orjson.dumps(body), payload=body)


def test_the_key_ignores_delivery_fields_and_key_order() -> None:
    plain = cache_key(ctx(temperature=0))
    assert cache_key(ctx(temperature=0, stream=True, user="u",
                         stream_options={"include_usage": True})) == plain
    reordered = factories.request(payload={"temperature": 0, "messages": MESSAGES, "model": "m"})
    assert cache_key(reordered) == plain


def test_the_key_changes_with_what_changes_the_answer() -> None:
    plain = cache_key(ctx(temperature=0))
    assert cache_key(ctx(temperature=0, max_tokens=5)) != plain
    assert cache_key(ctx(temperature=0, seed=1)) != plain
    assert cache_key(ctx("/v1/completions", temperature=0)) != plain


def test_only_low_temperature_single_choice_requests_are_kept() -> None:
    cache = ReplyCache(DegradedSection())
    assert cache.wants(ctx(temperature=0))
    assert not cache.wants(ctx())  # absent = 1.0, the OpenAI default
    assert not cache.wants(ctx(temperature=0.7))
    assert not cache.wants(ctx(temperature=0, n=2))
    assert cache.wants(ctx("/v1/embeddings"))
    assert ReplyCache(DegradedSection(cache_max_temperature=1.0)).wants(ctx())
    assert not ReplyCache(DegradedSection(cache=False)).wants(ctx(temperature=0))


def test_without_redis_the_local_copy_answers_and_the_size_cap_holds() -> None:
    async def main() -> tuple[bytes | None, bytes | None]:
        cache = ReplyCache(DegradedSection(cache_max_bytes=1024, local_entries=4))
        small, big = ctx(temperature=0), ctx(temperature=0, max_tokens=9)
        cache.keep(small, [b'{"choices": ', b"[]}"], stream=False)
        cache.keep(big, [b"x" * 2048], stream=False)
        await cache.aclose()
        return await cache.lookup(small), await cache.lookup(big)

    small, big = asyncio.run(main())
    assert small == b'{"choices": []}' and big is None


def test_the_same_question_answered_again_soon_is_not_kept_again() -> None:
    """A second answer within a tenth of the TTL is neither folded nor written (only its id
    and timestamp would differ); once that tenth has passed, it replaces the first."""

    async def main() -> list[bytes | None]:
        cache = ReplyCache(DegradedSection(cache_ttl=10.0, local_entries=4))
        question = ctx(temperature=0)
        seen = []
        for body, wait in ((b'{"id":"first"}', 0.0), (b'{"id":"second"}', 1.2),
                           (b'{"id":"third"}', 0.0)):
            cache.keep(question, [body], stream=False)
            await cache._queue.join()
            seen.append(await cache.lookup(question))
            if wait:
                # a tenth of the TTL passes (the clock is moved, not waited for)
                key = cache_key(question)
                expiry, kept = cache._local[key]
                cache._local[key] = (expiry - wait, kept)
        await cache.aclose()
        return seen

    assert asyncio.run(main()) == [b'{"id":"first"}', b'{"id":"first"}', b'{"id":"third"}']
