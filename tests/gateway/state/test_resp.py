"""The link's own RESP connection (``gateway/state/resp.py``): a batch sent after another
batch's overdue reply dropped the connection fails as a connection failure (which the
link counts and answers), never as an AssertionError (a traceback in the log: CI's fuzz
run on 226d6d8 logged one while valkey stalled)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.state.link import FAILURES
from gateway.state.resp import Resp


def test_a_batch_sent_after_the_connection_was_dropped_fails_as_a_connection_failure() -> None:
    async def main() -> None:
        resp = Resp({"host": "127.0.0.1", "port": 1})
        resp.drop(ConnectionError("a reply overdue"))  # what another batch's watch does
        future = resp.send([("PING",)])
        with pytest.raises(FAILURES):
            await future
    asyncio.run(main())
