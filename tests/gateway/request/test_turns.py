"""A conversation's tokens remembered from one turn to the next (``gateway.request.turns``):
a later turn is known by its history's digest, what it adds past a third of its
characters has it tokenized whole again, and the memory is bounded."""

from __future__ import annotations

from typing import Any

from gateway.request.turns import SLACK, Turns, conversation

SYSTEM = {"role": "system", "content": "s" * 300}


def chat(*turns: str, **more: Any) -> dict[str, Any]:
    """A chat whose history alternates user and assistant messages after the system."""
    messages = [SYSTEM] + [{"role": ("user", "assistant")[i % 2], "content": text}
                           for i, text in enumerate(turns)]
    return {"messages": messages, **more}


def tokens(n: int) -> list[int]:
    return list(range(1, n + 1))


def test_a_later_turn_is_known_by_the_turn_before_it() -> None:
    turns = Turns()
    first = conversation("m", chat("q1"))
    assert first is not None and turns.recall(first) is None  # nothing before it
    turns.keep(first, tokens(120))
    second = conversation("m", chat("q1", "a1", "q2"))
    assert second is not None
    known = turns.recall(second)
    assert known is not None and list(known.tokens) == tokens(120 - SLACK)
    third = conversation("m", chat("q1", "a1", "q2", "a2", "q3"))
    assert third is not None  # known by the second's messages: the same start
    assert (again := turns.recall(third)) is not None and again.tokens == known.tokens


def test_the_model_and_the_rendering_fields_are_part_of_the_key() -> None:
    turns = Turns()
    first = conversation("m", chat("q1"))
    assert first is not None
    turns.keep(first, tokens(120))
    for model, body in (("other", chat("q1", "a1", "q2")),
                        ("m", chat("q1", "a1", "q2", chat_template_kwargs={"x": 1})),
                        ("m", chat("q1", "a1", "q2", tools=[{"type": "function"}]))):
        talk = conversation(model, body)
        assert talk is not None and turns.recall(talk) is None
    edited = conversation("m", {"messages": [{"role": "system", "content": "t" * 300},
                                             {"role": "user", "content": "q1"},
                                             {"role": "assistant", "content": "a1"},
                                             {"role": "user", "content": "q2"}]})
    assert edited is not None and turns.recall(edited) is None  # another history


def test_a_turn_that_adds_over_a_third_of_its_characters_is_tokenized_whole() -> None:
    turns = Turns()
    first = conversation("m", chat("q1"))
    assert first is not None
    turns.keep(first, tokens(120))
    long = conversation("m", chat("q1", "a1", "q" * 200))  # 302 known of 504
    assert long is not None and turns.recall(long) is None


def test_what_is_kept_is_bounded_oldest_out() -> None:
    turns = Turns(cap=1000)
    talks = [conversation("m", chat(f"question {i}")) for i in range(5)]
    for talk in talks:
        assert talk is not None
        turns.keep(talk, tokens(400 + SLACK))
    assert len(turns) == 2  # 400 each, 1000 at most: the newest two
    assert all(conversation("m", c) is None for c in ({"messages": []}, {"prompt": "x"}))
