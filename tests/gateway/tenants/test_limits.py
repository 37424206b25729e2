"""Each key's limits alone (issue 37): requests and tokens per minute and requests at once,
taken by the limits script in the in-memory link (``tests.memlink``), given back and
corrected by usage when a request ends, each process's share while Redis is away
(``fail_open``) or 503 (``fail_closed``), and the model allow-list; then the same through
the real request path (``gateway.build`` with in-memory backends and one in-memory link
shared by two replicas), as a client sees them. No socket, no process."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import GatewayApp
from gateway.build import build
from gateway.config.tenancy import LimitsSection
from gateway.errors import Forbidden, GatewayError, NoBackend, RateLimited
from gateway.metrics import Metrics
from gateway.tenants.keyring import Tenant
from gateway.tenants.limits import Admission, Limits
from tests.factories import config, request
from tests.fakes import FakeUpstream, Reply, always, call, completion, held
from tests.memlink import Clock, MemoryLink, built_with

MINUTE = 30_000_000  # a minute since the epoch
NOW = MINUTE * 60 + 7.0  # 7 s into it: a refusal says to come back in 53 s
ALICE = Tenant("alice", rpm=3)
CAROL = Tenant("carol", tpm=400)
BOB = Tenant("bob", models=frozenset({"m"}), max_concurrent=1)


def limits(link: MemoryLink | None, clock: Clock | None = None, processes: int = 1,
           stale: float = 600.0, **settings: Any) -> Limits:
    return Limits(link, LimitsSection(**settings), processes, stale, Metrics(),  # type: ignore[arg-type]
                  clock=clock or Clock(NOW))


def asking(rid: str = "r", model: str = "m", prompt: int = 400, max_tokens: int = 50) -> Any:
    """A request estimated at prompt / 4 + max_tokens tokens (150 by default)."""
    return request(request_id=rid, model=model, body=b"x" * prompt,
                   payload={"max_tokens": max_tokens})


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


async def verdicts(gate: Limits, tenant: Tenant, n: int, **kw: Any) -> list[str]:
    """``n`` admissions in turn: "ok", or the refusal's status and kind."""
    out = []
    for i in range(n):
        try:
            await gate.admit(tenant, asking(f"r{i}", **kw))
            out.append("ok")
        except GatewayError as exc:
            out.append(f"{exc.status} {exc.kind}")
    return out


def retry_after(exc: GatewayError) -> str:
    return dict(exc.headers or [])[b"retry-after"].decode()


def rejections(gate: Limits, tenant: str, limit: str) -> float:
    return float(gate._metrics.limit_rejections.labels(tenant, limit)._value.get())


def test_requests_per_minute_refuse_the_next_with_the_window_left() -> None:
    link, clock = MemoryLink(), Clock(NOW)
    gate = limits(link, clock)

    async def main() -> None:
        assert await verdicts(gate, ALICE, 3) == ["ok"] * 3
        with pytest.raises(RateLimited) as info:
            await gate.admit(ALICE, asking("r3"))
        assert info.value.status == 429 and info.value.kind == "requests"
        assert info.value.code == "rate_limit_exceeded"
        assert info.value.message == ("Rate limit reached for key 'alice' on requests per "
                                      "minute: limit 3. Retry after 53 s.")
        assert retry_after(info.value) == "53"
        clock.now += 60  # the next minute counts afresh
        assert await verdicts(gate, ALICE, 4) == ["ok"] * 3 + ["429 requests"]

    run(main())
    assert rejections(gate, "alice", "rpm") == 2
    assert link.run("GET", f"t:lim:alice:r:{MINUTE}") == "3"
    assert 115_000 < link.run("PTTL", f"t:lim:alice:r:{MINUTE}") <= 120_000  # kept 2 min


def test_tokens_per_minute_refuse_once_spent_the_first_always_goes() -> None:
    link = MemoryLink()
    gate = limits(link)

    async def main() -> None:
        # 150 each: 150, 300, then 450 > 400.
        assert await verdicts(gate, CAROL, 3) == ["ok", "ok", "429 tokens"]
        with pytest.raises(RateLimited) as info:
            await gate.admit(CAROL, asking("r9"))
        assert info.value.message == ("Rate limit reached for key 'carol' on tokens per "
                                      "minute: limit 400. Retry after 53 s.")
        assert retry_after(info.value) == "53"
        # Alone in a fresh window, one larger than the whole limit still goes.
        other = Tenant("dave", tpm=100)
        assert await verdicts(gate, other, 2, max_tokens=500) == ["ok", "429 tokens"]

    run(main())
    assert link.run("GET", f"t:lim:carol:t:{MINUTE}") == "300"


def test_a_request_without_max_tokens_is_charged_the_default() -> None:
    link = MemoryLink()
    gate = limits(link, default_max_tokens=100)

    async def main() -> None:
        await gate.admit(CAROL, request(request_id="r", body=b"x" * 40, payload={}))

    run(main())
    assert link.run("GET", f"t:lim:carol:t:{MINUTE}") == "110"


def test_concurrency_refuses_while_held_and_release_gives_the_place_back() -> None:
    link = MemoryLink()
    gate = limits(link)

    async def main() -> None:
        first = await gate.admit(BOB, asking("first"))
        assert isinstance(first, Admission)
        with pytest.raises(RateLimited) as info:
            await gate.admit(BOB, asking("second"))
        assert info.value.message == "key 'bob' has 1 requests in flight, its limit"
        assert retry_after(info.value) == "1" and info.value.kind == "requests"
        gate.release(first, used=None)
        await link.settled()  # off the request path
        assert await verdicts(gate, BOB, 1) == ["ok"]

    run(main())
    assert ("ZREM", "t:lim:bob:c", "first") in link.sent
    assert rejections(gate, "bob", "concurrency") == 1


def test_a_place_held_longer_than_a_request_may_take_is_dropped() -> None:
    """A replica that died holding a place does not hold it forever: members older than
    the longest a request may take (``stale``) are dropped."""
    link, clock = MemoryLink(), Clock(NOW)
    gate = limits(link, clock, stale=120.0)

    async def main() -> None:
        await gate.admit(BOB, asking("lost"))  # never released
        clock.now += 119
        assert await verdicts(gate, BOB, 1) == ["429 requests"]
        clock.now += 2
        assert await verdicts(gate, BOB, 1) == ["ok"]

    run(main())


def test_release_corrects_the_tokens_to_what_vllm_counted() -> None:
    link = MemoryLink()
    gate = limits(link)
    key = f"t:lim:carol:t:{MINUTE}"

    async def main() -> None:
        a = await gate.admit(CAROL, asking("a"))  # 150 estimated
        b = await gate.admit(CAROL, asking("b"))
        assert a is not None and b is not None and a.estimate == 150
        gate.release(a, used=20)
        gate.release(b, used=None)  # no usage: the estimate stands
        await link.settled()
        assert link.run("GET", key) == "170"
        assert await verdicts(gate, CAROL, 2) == ["ok", "429 tokens"]  # 320, then 470

    run(main())


@pytest.mark.parametrize(("replicas", "processes", "share"), [(1, 1, 6), (1, 2, 3), (2, 2, 1)])
def test_fail_open_takes_this_process_share_of_each_limit(
        replicas: int, processes: int, share: int) -> None:
    link, clock = MemoryLink(), Clock(NOW)
    link.down = True
    gate = limits(link, clock, processes, replicas=replicas)
    tenant = Tenant("t", rpm=6)

    async def main() -> None:
        assert await verdicts(gate, tenant, share + 1) == ["ok"] * share + ["429 requests"]
        clock.now += 60
        assert await verdicts(gate, tenant, 1) == ["ok"]

    run(main())
    assert link.store.keys() == []  # nothing reached Redis


def test_fail_open_shares_concurrency_and_tokens_and_gives_them_back() -> None:
    link = MemoryLink()
    link.down = True
    gate = limits(link, processes=2)  # shares: 2 at once, 200 tokens a minute
    tenant = Tenant("t", tpm=400, max_concurrent=4)

    async def main() -> None:
        a = await gate.admit(tenant, asking("a", prompt=0, max_tokens=90))
        b = await gate.admit(tenant, asking("b", prompt=0, max_tokens=90))
        assert a is not None and b is not None and a.local and b.local
        assert await verdicts(gate, tenant, 1, prompt=0, max_tokens=1) == ["429 requests"]
        gate.release(a, used=10)  # its place back at once, its tokens 90 -> 10
        assert await verdicts(gate, tenant, 1, prompt=0, max_tokens=90) == ["ok"]  # 190
        assert await verdicts(gate, tenant, 1, prompt=0, max_tokens=20) == ["429 tokens"]

    run(main())


def test_limits_count_in_redis_again_once_it_answers() -> None:
    link = MemoryLink()
    gate = limits(link)

    async def main() -> None:
        link.down = True
        assert await verdicts(gate, ALICE, 1) == ["ok"]  # locally
        link.down = False
        assert await verdicts(gate, ALICE, 4) == ["ok"] * 3 + ["429 requests"]

    run(main())


def test_a_script_error_counts_as_redis_away() -> None:
    link = MemoryLink()
    link.broken.add("EVAL")
    gate = limits(link, processes=3)

    async def main() -> None:
        admission = await gate.admit(ALICE, asking())
        assert admission is not None and admission.local  # share: max(1, 3 // 3)
        assert await verdicts(gate, ALICE, 1) == ["429 requests"]

    run(main())


def test_fail_closed_answers_503_to_limited_keys_only() -> None:
    link = MemoryLink()
    link.down = True
    gate = limits(link, on_redis_down="fail_closed")

    async def main() -> None:
        with pytest.raises(NoBackend) as info:
            await gate.admit(ALICE, asking())
        assert info.value.status == 503
        assert info.value.message == "limits can't be checked now; retry shortly"
        assert await gate.admit(Tenant("free"), asking()) is None
        link.down = False
        assert await verdicts(gate, ALICE, 1) == ["ok"]

    run(main())
    assert rejections(gate, "alice", "redis") == 1


def test_a_model_outside_the_keys_list_is_403_before_any_limit() -> None:
    link = MemoryLink()
    gate = limits(link)

    async def main() -> None:
        with pytest.raises(Forbidden) as info:
            await gate.admit(BOB, asking(model="other"))
        assert info.value.status == 403 and info.value.code == "model_not_allowed"
        assert info.value.message == "key 'bob' may not use model 'other'"
        assert info.value.param == "model"
        unlimited = Tenant("u", models=frozenset({"m"}))
        assert await gate.admit(unlimited, asking()) is None

    run(main())
    assert link.sent == []  # refused before the round trip
    assert rejections(gate, "bob", "model") == 1


# The same through the real request path, as a client sees it.

KEYS = {"alice": "alice-secret-key-1", "bob": "bob-secret-key-22", "carol": "carol-secret-3"}
A = "http://a.test:8000"
BODY = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


def keyed(policy: str = "fail_open", **sections: Any) -> Any:
    digest = hashlib.sha256(KEYS["bob"].encode()).hexdigest()
    return config(
        backends=[{"name": "a", "url": A}],
        gateway={"workers": 1},  # fail_open's share: the limit / (1 replica x 1 worker)
        redis={"url": "redis://127.0.0.1:1/0"},  # in memory: nothing connects
        limits={"on_redis_down": policy},
        keys=[{"name": "alice", "key": KEYS["alice"], "rpm": 3},
              {"name": "bob", "key": f"sha256:{digest}", "models": ["m"], "max_concurrent": 1},
              {"name": "carol", "key": KEYS["carol"], "tpm": 400}],
        **sections)


@pytest.fixture
def link(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryLink]:
    memory = MemoryLink()
    built_with(memory, monkeypatch)
    yield memory


def replica(upstream: FakeUpstream, policy: str = "fail_open") -> GatewayApp:
    """One gateway process, its backend ready with model ``m``."""
    cfg = keyed(policy)
    app = GatewayApp(cfg, parts=build(cfg, upstream=upstream))
    for backend in app.parts.pool.backends:
        backend.mark_ready()
        backend.learn(frozenset({"m"}), None)
    return app


def key(name: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {KEYS[name]}".encode())]


def test_requests_per_minute_hold_across_two_replicas_sharing_redis(link: MemoryLink) -> None:
    upstream = FakeUpstream({A: always(completion())})
    one, two = replica(upstream), replica(upstream)

    async def main() -> list[Any]:
        return [await call(gw, BODY, headers=key("alice")) for gw in (one, two, one, two)]

    answers = run(main())
    assert [a.status for a in answers] == [200, 200, 200, 429]
    refused = answers[-1]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "alice" in error["message"] and KEYS["alice"] not in refused.body.decode()
    assert len(upstream.sent) == 3
    assert two.parts.metrics.limit_rejections.labels("alice", "rpm")._value.get() == 1


def test_concurrency_is_one_at_a_time_across_replicas(link: MemoryLink) -> None:
    release = asyncio.Event()
    upstream = FakeUpstream({A: held(completion(), release)})
    one, two = replica(upstream), replica(upstream)

    async def main() -> None:
        first = asyncio.create_task(call(one, BODY, headers=key("bob")))
        while not upstream.sent:  # noqa: ASYNC110 (the fake's own record)
            await asyncio.sleep(0)
        second = await call(two, BODY, headers=key("bob"))
        assert second.status == 429 and second.headers["retry-after"] == "1"
        assert "requests in flight" in second.json()["error"]["message"]
        release.set()
        assert (await first).status == 200
        await link.settled()  # its place given back off the request path
        assert (await call(two, BODY, headers=key("bob"))).status == 200

    run(main())


def test_tokens_are_corrected_by_the_replys_usage_and_refuse_once_spent(
        link: MemoryLink) -> None:
    upstream = FakeUpstream({A: always(completion())})  # usage: 2 tokens
    gw = replica(upstream)
    big = {**BODY, "max_tokens": 300}  # estimated 300 and more

    async def main() -> list[int]:
        statuses = []
        for _ in range(3):
            statuses.append((await call(gw, big, headers=key("carol"))).status)
            await link.settled()
        return statuses

    # Each is corrected to the 2 tokens it used, so none is refused.
    assert run(main()) == [200, 200, 200]
    minute = int(time.time() // 60)  # the built gateway's clock: the minute may just turn
    assert sum(int(link.run("GET", f"vgw:lim:carol:t:{m}") or 0)
               for m in (minute - 1, minute)) == 6

    upstream.backends[A] = always(_usage(completion(), 300))

    async def spend() -> list[Any]:
        out = []
        for _ in range(3):
            out.append(await call(gw, big, headers=key("carol")))
            await link.settled()
        return out

    answers = run(spend())
    assert 429 in [a.status for a in answers]
    refused = next(a for a in answers if a.status == 429)
    assert refused.json()["error"]["type"] == "tokens"


def _usage(reply: Reply, completion_tokens: int) -> Reply:
    body = orjson.loads(reply.chunks[0])
    body["usage"] = {"prompt_tokens": 1, "completion_tokens": completion_tokens,
                     "total_tokens": completion_tokens + 1}
    return Reply.json(200, body)


def test_a_digest_key_works_and_its_models_are_enforced(link: MemoryLink) -> None:
    upstream = FakeUpstream({A: always(completion())})
    gw = replica(upstream)

    async def main() -> list[Any]:
        digest = hashlib.sha256(KEYS["bob"].encode()).hexdigest()
        return [await call(gw, BODY, headers=key("bob")),
                await call(gw, {**BODY, "model": "other"}, headers=key("bob")),
                await call(gw, BODY, headers=[(b"authorization",
                                               f"Bearer sha256:{digest}".encode())])]

    ok, other, digest = run(main())
    assert ok.status == 200
    assert other.status == 403 and other.json()["error"]["code"] == "model_not_allowed"
    assert digest.status == 401
    assert len(upstream.sent) == 1


def test_an_unknown_key_is_refused_and_x_api_key_is_accepted(link: MemoryLink) -> None:
    upstream = FakeUpstream({A: always(completion())})
    gw = replica(upstream)
    messages = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

    async def main() -> list[Any]:
        return [await call(gw, BODY, headers=[(b"authorization", b"Bearer not-a-key-at-all")]),
                await call(gw, messages, "/v1/messages",
                           headers=[(b"x-api-key", KEYS["bob"].encode())])]

    unknown, anthropic = run(main())
    assert unknown.status == 401 and unknown.json()["error"]["code"] == "invalid_api_key"
    assert anthropic.status == 200
    assert [url for url, _ in upstream.sent] == [A + "/v1/messages"]


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_with_redis_down_the_policy_holds(link: MemoryLink, policy: str) -> None:
    upstream = FakeUpstream({A: always(completion())})
    gw = replica(upstream, policy)

    async def main() -> list[int]:
        statuses = [(await call(gw, BODY, headers=key("alice"))).status]
        link.down = True
        statuses += [(await call(gw, BODY, headers=key("alice"))).status for _ in range(4)]
        return statuses

    statuses = run(main())
    if policy == "fail_open":
        # This process's share (rpm 3 / 1 replica x 1 worker) counted locally.
        assert statuses == [200, 200, 200, 200, 429]
    else:
        assert statuses == [200, 503, 503, 503, 503]


def test_the_admin_view_sums_each_keys_use_across_replicas(link: MemoryLink) -> None:
    upstream = FakeUpstream({A: always(completion())})
    one, two = replica(upstream), replica(upstream)

    async def main() -> dict[str, Any]:
        for gw in (one, two):
            assert (await call(gw, BODY, headers=key("bob"))).status == 200
            await link.settled()
        transport = httpx.ASGITransport(app=one)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            view = await client.get("/admin/keys")  # loopback: no admin key needed
        assert view.status_code == 200
        for secret in KEYS.values():
            assert secret not in view.text
        result: dict[str, Any] = view.json()
        return result

    view = run(main())
    bob = next(k for k in view["keys"] if k["name"] == "bob")
    assert bob["totals"] == {"requests": 2, "prompt_tokens": 2, "completion_tokens": 2,
                             "batch_requests": 0, "batch_prompt_tokens": 0,
                             "batch_completion_tokens": 0}
    assert bob["max_concurrent"] == 1 and bob["models"] == ["m"]
    assert view["window_s"] == 3600


def test_a_request_that_leaves_while_its_limits_are_taken_gives_its_place_back() -> None:
    """The client hangs up while the limits script is on its way: Redis takes the place
    all the same, and it is given back when the answer comes (else the key would be
    refused for the longest a request may take)."""
    from gateway.canary.rollout import Canary
    from gateway.config import CanarySection
    from gateway.request.lookup import Lookup
    from gateway.routing.pool import BackendPool
    from gateway.routing.responses import ResponsePins
    from gateway.tenants.gate import TenantGate
    from gateway.tenants.keyring import Keyring
    from gateway.tenants.ledger import Ledger
    from gateway.types import Record

    class Held(MemoryLink):
        def __init__(self) -> None:
            super().__init__(clock=Clock(NOW))
            self.answer = asyncio.Event()

        async def execute(self, *commands: Any, patient: bool = False) -> tuple[bool, list[Any]]:
            await self.answer.wait()
            return await super().execute(*commands, patient=patient)

    async def main() -> int:
        link, metrics = Held(), Metrics()
        limits = Limits(link, LimitsSection(), 1, 60, metrics,  # type: ignore[arg-type]
                        clock=lambda: NOW)
        gate = TenantGate(limits, Ledger(link, Keyring(), 60))  # type: ignore[arg-type]
        lookup = Lookup(link, None, None, Canary(CanarySection(), metrics),  # type: ignore
                        ResponsePins(None, 60, BackendPool([])), gate)
        record = Record(request(request_id="leaving"))
        admission = limits.prepare(BOB, record.request)
        assert admission is not None
        asking = asyncio.ensure_future(lookup(record, admission, None))
        await asyncio.sleep(0)
        asking.cancel()  # the client left
        link.answer.set()
        with pytest.raises(asyncio.CancelledError):
            await asking
        running = link.prefix + "lim:bob:c"
        end = asyncio.get_running_loop().time() + 5
        def given_back() -> bool:  # the script ran, and what it took is back
            ran = any(c[0] == "EVAL" for c in link.sent)
            return ran and link.run("ZCARD", running) == 0
        while not given_back() and asyncio.get_running_loop().time() < end:  # noqa: ASYNC110
            await asyncio.sleep(0)
        await link.settled()
        return int(link.run("ZCARD", running))

    assert asyncio.run(main()) == 0
