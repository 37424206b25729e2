"""Logging for the gateway's processes (the CLI and every worker)."""

from __future__ import annotations

import logging
import sys


class DropExpected(logging.Filter):
    """Keep uvicorn from printing tracebacks for connections dropped on purpose."""

    def __init__(self, *kinds: type[BaseException]) -> None:
        super().__init__()
        self._kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, self._kinds)


def setup(level: str, *expected: type[BaseException]) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if expected:
        logging.getLogger("uvicorn.error").addFilter(DropExpected(*expected))
