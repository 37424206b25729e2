"""A request's task is cancelled when its client hangs up: through the connection's callback
under uvicorn (the gateway's protocol in the scope's extensions), through a watcher task
waiting for ``http.disconnect`` under any other server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.http.sink import CONNECTION, Hangup


class Connection:
    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None

    def on_hangup(self, callback: Callable[[], None] | None) -> None:
        self.callback = callback


async def never() -> dict[str, object]:
    await asyncio.Event().wait()
    return {}


def test_the_connection_callback_cancels_the_task_and_is_undone_at_the_end() -> None:
    conn = Connection()

    async def main() -> tuple[bool, bool]:
        async def request() -> None:
            hangup = Hangup({"extensions": {CONNECTION: conn}}, never)
            try:
                await asyncio.sleep(10)
            finally:
                hangup.cancel()
                seen.append(hangup.done())

        seen: list[bool] = []
        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        assert conn.callback is not None
        conn.callback()  # the client hung up
        try:
            await task
        except asyncio.CancelledError:
            return seen[0], conn.callback is None
        return False, False

    assert asyncio.run(main()) == (True, True)


def test_without_the_extension_a_watcher_waits_for_http_disconnect() -> None:
    async def main() -> bool:
        gone = asyncio.Event()

        async def receive() -> dict[str, object]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def request() -> bool:
            hangup = Hangup({}, receive)
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return hangup.done()
            finally:
                hangup.cancel()
            return False

        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        gone.set()
        return await task

    assert asyncio.run(main()) is True
