"""The pool's view of which models exist: those a backend said it serves, and those the
config declares before any backend answered (issue 36)."""

from __future__ import annotations

from gateway.config import ModelRoute
from gateway.routing.names import ModelNames
from gateway.routing.pool import BackendPool
from tests.factories import backend


def test_a_model_the_config_declares_is_known_before_any_backend_answered() -> None:
    spawned = backend("s", spawn={"model": "/models/llama", "port": 9001,
                                  "served_model_name": "llama"}, group="canary")
    down = backend("u", "http://127.0.0.1:9")  # never answered: its models are unknown
    routes = [ModelRoute(name="big", fallback="small"),
              ModelRoute(name="chat", groups={"canary": "llama"})]
    pool = BackendPool([spawned, down], names=ModelNames(routes))
    assert not pool.known_model("big") and pool.declared("big")
    assert pool.declared("chat")  # the canary group serves it as "llama"
    assert not pool.declared("llama")  # clients call it "chat" in that group
    assert pool.declared("small")  # named as big's fallback
    assert not pool.declared("invented")


def test_a_spawned_backends_model_is_declared_by_its_served_name() -> None:
    pool = BackendPool([backend("s", spawn={"model": "/models/tiny", "port": 9001})])
    assert pool.declared("/models/tiny")
    assert not pool.known_model("/models/tiny")
