from __future__ import annotations

from backends.backend import Backend
from backends.health import ProbeResult
from backends.spec import BackendSpec
from backends.supervisor import Supervisor, SupervisorSettings


async def _probe(_: Backend) -> ProbeResult:
    return ProbeResult(ok=False)


def supervisor(jitter: float) -> Supervisor:
    backend = Backend(BackendSpec.model_validate(
        {"name": "s", "spawn": {"model": "m", "port": 9}}))
    settings = SupervisorSettings(backoff_initial=1.0, backoff_max=8.0)
    return Supervisor(backend, settings, _probe, jitter=lambda: jitter)


def test_backoff_doubles_with_equal_jitter_and_is_capped() -> None:
    low, high = supervisor(0.0), supervisor(1.0)
    assert [low.backoff(n) for n in (1, 2, 3, 4, 5, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert [high.backoff(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_repr_summarises_state() -> None:
    assert repr(supervisor(0.5)) == "<Supervisor s [starting | pid None | restarts 0]>"
