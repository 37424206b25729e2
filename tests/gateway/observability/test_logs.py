"""Log lines a client's value cannot break: text fields quoted when they must be, JSON lines
with nothing a line reader splits on."""

from __future__ import annotations

import json
import logging

import pytest

from gateway.observability.access_log import AGENT_CHARS, user_agent
from gateway.observability.logs import TextFormatter, field, json_line


@pytest.mark.parametrize(("value", "written"), [
    ("plain/1.0", "plain/1.0"),
    ("", '""'),
    ("two words", '"two words"'),
    ("a=b", '"a=b"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("back\\slash", '"back\\\\slash"'),
    ("line\nbreak\x1b[31m", '"line\\nbreak\\x1b[31m"'),
    ("nel\x85sep\u2028", '"nel\\x85sep\\u2028"'),
])
def test_a_text_field_is_plain_or_quoted_and_escaped(value: str, written: str) -> None:
    assert field(value) == written


def test_a_text_line_keeps_a_forged_field_inside_its_value() -> None:
    record = logging.LogRecord("gateway.access", logging.INFO, "", 0, "request", None, None)
    record.fields = {"user_agent": 'x" status=500 "', "status": 200}
    line = TextFormatter().format(record)
    assert line.endswith(' user_agent="x\\" status=500 \\"" status=200')


def test_a_json_line_escapes_what_splitlines_would_split_on() -> None:
    text = json_line({"ua": "a\x85b\u2028c\u2029d\x7fe\nf"})
    assert text.splitlines() == [text]
    assert json.loads(text) == {"ua": "a\x85b\u2028c\u2029d\x7fe\nf"}


def test_the_user_agent_is_read_from_the_headers_and_cut() -> None:
    assert user_agent([(b"host", b"x"), (b"user-agent", b"curl/8.5")]) == "curl/8.5"
    assert user_agent([(b"host", b"x")]) is None
    assert user_agent([(b"user-agent", b"\xff" * 10_000)]) == "\xff" * AGENT_CHARS
