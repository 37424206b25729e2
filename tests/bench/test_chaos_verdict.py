"""The chaos soak's verdict on made-up records: what it counts as silent truncation,
disorder, an unexplained move or a recovery time, so that its zeros mean something."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from bench.chaos.clients import Rec, _judge
from bench.chaos.faults import Fault
from bench.chaos.verdict import failures, log_causes, recovery, summarize, switches


def rec(session: str, start: float, backend: str, outcome: str = "ok") -> Rec:
    return Rec(0, 0, session, "sim-model", True, start, start + 0.5, outcome, backend)


def test_a_short_or_unfinished_reply_is_truncated_and_a_repeated_token_disordered() -> None:
    whole, short, unfinished, repeated = (rec("s", 0, "s1", "") for _ in range(4))
    _judge(whole, " tok0 tok1 tok2", "length", 3)
    _judge(short, " tok0 tok1", "length", 3)
    _judge(unfinished, " tok0 tok1 tok2", None, 3)
    _judge(repeated, " tok0 tok1 tok1", "length", 3)
    assert whole.outcome == "ok" and not whole.disordered
    assert short.outcome == unfinished.outcome == "truncated"
    assert repeated.disordered


def test_a_move_is_explained_only_by_a_fault_of_the_backend_it_left_or_of_redis() -> None:
    records = [rec("a", 1, "s1"), rec("a", 5, "s2"), rec("b", 1, "s2"), rec("b", 5, "s3"),
               rec("c", 40, "s3"), rec("c", 44, "s1")]
    faults = [Fault("kill_backend", "s1", 2, 4)]  # a left s1 while it was down
    explained, unexplained = switches(records, faults)
    assert explained == 1
    assert [(u["session"], u["from"]) for u in unexplained] == [("b", "s2"), ("c", "s3")]
    redis = [Fault("kill_redis", "valkey", 42, 43)]
    assert switches(records, faults + redis)[1] == [{"session": "b", "from": "s2",
                                                     "to": "s3", "at": 5, "request": ""}]
    # A return to a backend whose fault had sent the session away is explained too.
    back = [rec("d", 1, "s2"), rec("d", 10, "c1")]
    assert switches(back, [Fault("kill_backend", "c1", 0.5, 3)]) == (1, [])


def test_the_gateway_log_names_causes(tmp_path: Path) -> None:
    log = tmp_path / "gw.log"
    log.write_text(
        '{"ts":"2026-12-05T12:00:10.000Z","level":"warning","msg":"breaker s2: closed -> open"}\n'
        '{"ts":"2026-12-05T12:00:12.000Z","level":"warning","msg":"redis unavailable (x)"}\n'
        '{"ts":"2026-12-05T12:00:13.000Z","level":"info","msg":"request","attempts":1}\n')
    began = datetime.fromisoformat("2026-12-05T12:00:00+00:00").timestamp()
    causes = log_causes([log], began)
    assert [(c.kind, c.target, c.start) for c in causes] == [
        ("breaker_open", "s2", 10.0), ("redis_unavailable", "redis", 12.0)]


def test_recovery_is_the_wait_from_the_fault_to_the_sessions_next_answer() -> None:
    records = [rec("a", 1, "s1"), rec("a", 3, "s1", "stream_error"), rec("a", 4, "s2"),
               rec("b", 1, "s2"), rec("b", 4, "s2")]
    waits = recovery(records, [Fault("kill_backend", "s1", 2.5, 3)])
    assert waits["kill_backend"]["sessions"] == 1  # only a was on s1
    assert waits["kill_backend"]["max_s"] == 2.0  # its next answer ended at 4.5


def test_any_silent_loss_fails_the_run(tmp_path: Path) -> None:
    log = tmp_path / "gw.log"
    log.write_text('{"ts":"2026-12-05T12:00:13.000Z","level":"info","msg":"request",'
                   '"attempts":4}\n')
    clean = summarize([rec("a", 1, "s1")], [], [], [], 60, 0)
    assert failures(clean) == []
    bad = summarize([rec("a", 1, "s1", "truncated"), rec("b", 1, "s1", "hung")], [], [],
                    [log], 60, 0)
    assert failures(bad) == ["truncated = 1", "hung = 1", "over_attempts = 1"]
