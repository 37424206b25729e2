"""``/v1/files`` and ``/v1/batches`` as OpenAI serves them (the official SDKs' calls): an
upload is streamed to a temporary file under the body limit for files, checked line by
line in a worker thread while it is copied into the directory, and only then recorded.
Every record belongs to the key that made it."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from gateway.batch import lines as batch_lines
from gateway.batch.runner import ENDED, window_seconds
from gateway.batch.store import Store, StoreUnavailable, new_id, now, shown
from gateway.config.batch import BatchSection
from gateway.errors import error_body
from gateway.http.auth import TENANT
from gateway.http.form import is_form
from gateway.http.sink import close_lingering
from gateway.tenants.keyring import ANONYMOUS

log = logging.getLogger("gateway.batch")

SLACK = 64 * 1024  # bytes of multipart framing allowed beyond the file itself
MAX_METADATA = 16  # pairs, as OpenAI
MAX_CREATE = 64 * 1024  # bytes of a POST /v1/batches body


class TooLarge(Exception):
    pass


class Stalled(Exception):
    pass


def _error(status: int, message: str, code: str | None = None, param: str | None = None,
           kind: str = "invalid_request_error") -> Response:
    return Response(error_body(message, kind, code, param), status,
                    media_type="application/json")


def _closing(request: Request, status: int, message: str, code: str) -> Response:
    """A refusal sent before the body was all read (413, 408, a broken form): the
    connection closes, lingering so that a client still writing reads the answer."""
    close_lingering(request.scope)
    reply = _error(status, message, code)
    reply.headers["connection"] = "close"
    return reply


def _id(request: Request) -> str:
    """The path's file_id or batch_id."""
    return str(next(iter(request.path_params.values())))


def _owner(request: Request) -> str:
    return str(request.scope.get(TENANT, ANONYMOUS).who)


class BatchApi:
    def __init__(self, store: Store, settings: BatchSection, idle: float,
                 name_of: Callable[[str], str] = str) -> None:
        self._store = store
        self._name_of = name_of  # an owner's key name, for the status page
        self._settings = settings
        self._idle = idle  # seconds an upload may send nothing

    def routes(self) -> list[Route]:
        guard = self._guarded
        return [Route("/v1/files", guard(self._upload), methods=["POST"]),
                Route("/v1/files", guard(self._files), methods=["GET"]),
                Route("/v1/files/{file_id}", guard(self._file), methods=["GET"]),
                Route("/v1/files/{file_id}", guard(self._delete), methods=["DELETE"]),
                Route("/v1/files/{file_id}/content", guard(self._content), methods=["GET"]),
                Route("/v1/batches", guard(self._create), methods=["POST"]),
                Route("/v1/batches", guard(self._batches), methods=["GET"]),
                Route("/v1/batches/{batch_id}", guard(self._batch), methods=["GET"]),
                Route("/v1/batches/{batch_id}/cancel", guard(self._cancel), methods=["POST"])]

    @staticmethod
    def _guarded(endpoint: Any) -> Any:
        async def guarded(request: Request) -> Response:
            try:
                response: Response = await endpoint(request)
            except StoreUnavailable as exc:
                return Response(exc.body(), exc.status, dict(
                    (k.decode(), v.decode()) for k, v in exc.headers or []),
                    media_type="application/json")
            return response
        return guarded

    async def running(self) -> list[dict[str, Any]]:
        """The batches not yet ended, for the status page: progress and owner (a key's
        name, never the key); empty when Redis can't answer."""
        try:
            records = await self._store.open_records()
        except StoreUnavailable:
            return []
        return [{"id": r["id"], "key": self._name_of(r["_owner"]), "status": r["status"],
                 "endpoint": r["endpoint"], "created_at": r["created_at"],
                 "expires_at": r["expires_at"], **r["request_counts"]} for r in records]

    # Files.
    async def _upload(self, request: Request) -> Response:
        limit = self._settings.max_file_bytes
        if int(request.headers.get("content-length") or 0) > limit + SLACK:
            return _closing(request, 413, f"A file may hold at most {limit} bytes.",
                            "file_too_large")
        if not is_form(request.headers.get("content-type", "").encode("latin-1")):
            return _error(400, "The body must be multipart/form-data with a file and a "
                          "purpose.", "invalid_form")
        request._receive = _counted(request.receive, limit + SLACK, self._idle)
        try:
            form = await request.form(max_files=1, max_fields=8)
        except TooLarge:
            return _closing(request, 413, f"A file may hold at most {limit} bytes.",
                            "file_too_large")
        except Stalled:
            return _closing(request, 408, f"The upload sent nothing for {self._idle:g} s.",
                            "request_timeout")
        except Exception:
            return _closing(request, 400, "The body must be multipart/form-data with a file "
                            "and a purpose.", "invalid_form")
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "batch":
                return _error(400, "purpose must be 'batch'.", "invalid_purpose", "purpose")
            if not isinstance(upload, UploadFile):
                return _error(400, "A file part named 'file' is required.", "missing_file",
                              "file")
            return await self._keep(request, upload)
        finally:
            await form.close()

    async def _keep(self, request: Request, upload: UploadFile) -> Response:
        owner, file_id = _owner(request), new_id("file-")
        final = self._store.path(file_id)
        try:
            checked, size = await asyncio.to_thread(
                _copy_checked, upload, final, self._settings.max_lines)
        except batch_lines.BadLine as exc:
            return _error(400, f"The file is not a batch input: {exc}", "invalid_file", "file")
        except OSError as exc:  # a full or unwritable directory: said in the log only
            log.error("upload %s not stored: %s", file_id, exc)
            return _error(500, "The file could not be stored; try again later.",
                          "storage_error", kind="server_error")
        if await self._store.stored_bytes(owner, size) > self._settings.max_stored_bytes:
            await self._store.stored_bytes(owner, -size)
            await self._store.unlink(file_id)
            return _error(400, f"This key stores at most {self._settings.max_stored_bytes} "
                          "bytes of files; delete some first.", "storage_limit")
        record = {"id": file_id, "object": "file", "bytes": size, "created_at": now(),
                  "filename": (upload.filename or "batch.jsonl")[:255], "purpose": "batch",
                  "status": "processed", "expires_at": None, "status_details": None,
                  "_owner": owner, "_lines": checked.lines, "_routes": list(checked.routes)}
        await self._store.put("f", record, new=True)
        return JSONResponse(shown(record))

    async def _files(self, request: Request) -> Response:
        return await self._listed(request, "f")

    async def _file(self, request: Request) -> Response:
        record = await self._store.get("f", _id(request), _owner(request))
        return JSONResponse(shown(record)) if record else _missing("File", request)

    async def _content(self, request: Request) -> Response:
        record = await self._store.get("f", _id(request), _owner(request))
        path = self._store.path(record.get("_name", record["id"])) if record else None
        if path is None or not await asyncio.to_thread(path.is_file):
            return _missing("File", request)
        return FileResponse(path, media_type="application/jsonl")

    async def _delete(self, request: Request) -> Response:
        record = await self._store.get("f", _id(request), _owner(request))
        if record is None:
            return _missing("File", request)
        if await self._store.remove("f", record):  # the one call that removed it
            await self._store.stored_bytes(record["_owner"], -record["bytes"])
            await self._store.unlink(record.get("_name", record["id"]))
        return JSONResponse({"id": record["id"], "object": "file", "deleted": True})

    # Batches.
    async def _create(self, request: Request) -> Response:
        request._receive = _counted(request.receive, MAX_CREATE, self._idle)
        try:
            asked = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, "The body must be a JSON object.", "invalid_json")
        except TooLarge:
            return _closing(request, 413, f"A batch's request holds at most {MAX_CREATE} "
                            "bytes.", "body_too_large")
        except Stalled:
            return _closing(request, 408, f"The request sent nothing for {self._idle:g} s.",
                            "request_timeout")
        if not isinstance(asked, dict):
            return _error(400, "The body must be a JSON object.", "invalid_json")
        owner = _owner(request)
        problem = await self._refused(asked, owner)
        if isinstance(problem, Response):
            return problem
        created, batch_id = now(), new_id("batch_")
        record = {
            "id": batch_id, "object": "batch", "endpoint": asked["endpoint"],
            "errors": None, "input_file_id": asked["input_file_id"],
            "completion_window": asked["completion_window"], "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": created,
            "in_progress_at": None,
            "expires_at": created + (window_seconds(asked["completion_window"]) or 0),
            "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": problem, "completed": 0, "failed": 0},
            "metadata": asked.get("metadata"), "_owner": owner}
        limit = self._settings.max_open_batches
        if not await self._store.create(record, limit):
            return _error(429, f"This key has {limit} batches open; wait for one to end.",
                          "too_many_batches")
        return JSONResponse(shown(record))

    async def _refused(self, asked: dict[str, Any], owner: str) -> Response | int:
        """The refusal of a batch asked for, or (none) the lines of its input file."""
        endpoint, window = asked.get("endpoint"), asked.get("completion_window")
        if endpoint not in batch_lines.ROUTES:
            return _error(400, "endpoint must be one of " + ", ".join(batch_lines.ROUTES),
                          "invalid_endpoint", "endpoint")
        if not isinstance(window, str) or not window_seconds(window):
            return _error(400, "completion_window must be a duration such as '24h'.",
                          "invalid_completion_window", "completion_window")
        metadata = asked.get("metadata")
        if metadata is not None and not (
                isinstance(metadata, dict) and len(metadata) <= MAX_METADATA
                and all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64
                        and len(v) <= 512 for k, v in metadata.items())):
            return _error(400, "metadata must map at most 16 keys (64 characters) to "
                          "strings (512 characters).", "invalid_metadata", "metadata")
        file_id = asked.get("input_file_id")
        source = await self._store.get("f", file_id, owner) if isinstance(file_id, str) else None
        if source is None or source["purpose"] != "batch":
            return _error(400, "input_file_id must name a file uploaded with purpose "
                          "'batch'.", "invalid_input_file", "input_file_id")
        if set(source["_routes"]) != {endpoint}:
            return _error(400, f"Every line of the file must call {endpoint}.",
                          "mismatched_endpoint", "endpoint")
        return int(source["_lines"])

    async def _batches(self, request: Request) -> Response:
        return await self._listed(request, "b")

    async def _batch(self, request: Request) -> Response:
        record = await self._store.get("b", _id(request), _owner(request))
        return JSONResponse(shown(record)) if record else _missing("Batch", request)

    async def _cancel(self, request: Request) -> Response:
        record = await self._store.get("b", _id(request), _owner(request))
        if record is None:
            return _missing("Batch", request)
        if record["status"] in ENDED:
            return _error(409, f"A batch that is {record['status']} cannot be cancelled.",
                          "batch_ended")
        if record["status"] != "cancelling":
            record.update(status="cancelling", cancelling_at=now())
            if not await self._store.cancel(record):  # it ended meanwhile
                return await self._cancel(request)
        return JSONResponse(shown(record))

    async def _listed(self, request: Request, kind: str) -> Response:
        try:
            limit = max(1, min(10_000 if kind == "f" else 100,
                               int(request.query_params.get("limit", "20"))))
        except ValueError:
            return _error(400, "limit must be a number.", "invalid_limit", "limit")
        purpose = request.query_params.get("purpose") if kind == "f" else None
        records, more = await self._store.listed(
            kind, _owner(request), limit, request.query_params.get("after"),
            (lambda r: r.get("purpose") == purpose) if purpose is not None else None)
        data = [shown(r) for r in records]
        return JSONResponse({"object": "list", "data": data, "has_more": more,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})


def _missing(what: str, request: Request) -> Response:
    return _error(404, f"No such {what} object: {_id(request)[:100]}",
                  "not_found", "id")


def _counted(receive: Any, limit: int, idle: float) -> Any:
    """``receive``, refusing a body past ``limit`` bytes (``TooLarge``) or one that sends
    nothing for ``idle`` seconds (``Stalled``)."""
    total = 0

    async def counted() -> Message:
        nonlocal total
        try:
            async with asyncio.timeout(idle):
                message: Message = await receive()
        except TimeoutError:
            raise Stalled from None
        total += len(message.get("body", b""))
        if total > limit:
            raise TooLarge
        return message
    return counted


def _copy_checked(upload: UploadFile, final: Path, max_lines: int
                  ) -> tuple[batch_lines.Checked, int]:
    """In a worker thread: the upload checked and copied to ``final`` (removed if bad)."""
    source = upload.file
    source.seek(0)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as out:
            checked = batch_lines.check(_Tee(source, out), max_lines)
        os.replace(tmp, final)
    except BaseException:
        os.unlink(tmp)
        raise
    return checked, final.stat().st_size


class _Tee:
    """The upload's lines, each written to ``out`` as it is read."""

    def __init__(self, source: Any, out: Any) -> None:
        self._source, self._out = source, out

    def __iter__(self) -> Any:
        for raw in self._source:
            self._out.write(raw)
            yield raw
