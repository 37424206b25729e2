"""BodyBudget: the request bytes one process holds."""

from __future__ import annotations

from gateway.http.asgi import BodyBudget


def test_a_body_is_held_once_whatever_was_declared() -> None:
    budget = BodyBudget(1000)
    assert budget.take(0) and budget.take(600)  # chunked: nothing declared, then 600 came
    assert budget.held == 600
    assert not budget.take(500)  # over the cap: nothing changes
    assert budget.take(300) and budget.take(-100)  # declared 300, 200 came: 100 back
    assert budget.held == 800
    budget.give(600)
    budget.give(200)
    assert budget.held == 0
