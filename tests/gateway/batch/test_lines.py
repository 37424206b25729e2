"""A batch input file's lines: the first bad one named, whatever is wrong with it; and the
store's paths: only names the gateway makes."""

from __future__ import annotations

import pytest

from gateway.batch.lines import MAX_CUSTOM_ID, BadLine, check
from gateway.batch.store import Store

GOOD = b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}\n'


@pytest.mark.parametrize(("line", "says"), [
    (b"[1, 2]", "not a JSON object"),
    (b'{"custom_id": "a"', "not a JSON object"),
    (b"\xff\xfe", "not a JSON object"),
    (b'{"custom_id": 7, "method": "POST", "url": "/v1/embeddings", "body": {}}',
     "custom_id must be a string"),
    (b'{"custom_id": "' + b"x" * (MAX_CUSTOM_ID + 1) + b'", "method": "POST", "url": '
     b'"/v1/embeddings", "body": {}}', "custom_id must be a string"),
    (b'{"custom_id": "b", "method": "DELETE", "url": "/v1/embeddings", "body": {}}',
     "method must be POST"),
    (b'{"custom_id": "b", "method": "POST", "url": "/admin/reload", "body": {}}',
     "url must be one of"),
    (b'{"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": "x"}',
     "body must be a JSON object"),
    (b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", '
     b'"body": {"stream": true}}', "cannot stream"),
    (GOOD.strip(), "custom_id 'a' is repeated"),
])
def test_the_first_bad_line_is_named(line: bytes, says: str) -> None:
    with pytest.raises(BadLine, match=says) as bad:
        check([GOOD, b"\n", line + b"\n", b"never read"], 10)
    assert bad.value.line == 3


def test_a_file_is_checked_whole() -> None:
    lines = [GOOD.replace(b'"a"', f'"{i}"'.encode()) for i in range(5)]
    checked = check(lines, 5)
    assert (checked.lines, checked.routes) == (5, ("/v1/embeddings",))
    with pytest.raises(BadLine, match="at most 4 lines"):
        check(lines, 4)
    with pytest.raises(BadLine, match=r"^the file has no lines$"):
        check([b"\n", b"  \n"], 4)


@pytest.mark.parametrize("name", ["../x", "file-" + "0" * 23 + "/", "/etc/passwd",
                                  "file-" + "0" * 25, "batch_" + "0" * 24 + "/../../x",
                                  "batch_" + "0" * 24 + ".output.jsonl/../../x",
                                  "batch_" + "0" * 24, "FILE-" + "0" * 24, ""])
def test_only_the_gateways_own_names_make_a_path(name: str) -> None:
    store = Store.__new__(Store)
    with pytest.raises(ValueError):
        store.path(name)
