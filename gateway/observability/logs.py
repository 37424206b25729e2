"""Logging for the gateway's processes (the CLI and every worker): JSON lines by default,
or plain text. A record's ``fields`` (the request log's) become keys of their own."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson


class DropExpected(logging.Filter):
    """Keep uvicorn from printing tracebacks for connections dropped on purpose."""

    def __init__(self, *kinds: type[BaseException]) -> None:
        super().__init__()
        self._kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, self._kinds)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "pid": record.process,
            "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return text


def setup(level: str, *expected: type[BaseException], fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if expected:
        logging.getLogger("uvicorn.error").addFilter(DropExpected(*expected))
