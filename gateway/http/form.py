"""The text fields of a ``multipart/form-data`` body (the audio routes: ``model``,
``stream``, ``language``...), read with python-multipart from the bytes already held.

The file parts are walked over, never copied: the body is forwarded as it came, so the
upload is held once. A field's value is capped (``MAX_FIELD``); a body that is not valid
multipart is a 400 in the OpenAI format.
"""

from __future__ import annotations

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.errors import BadRequest

MAX_FIELD = 64 * 1024  # a text field longer than this is not one the gateway reads


def is_form(content_type: bytes) -> bool:
    return content_type[:19].lower() == b"multipart/form-data"


class _Fields:
    """python-multipart's callbacks: the current part's headers, and its data while it is
    a text field (no ``filename``)."""

    def __init__(self) -> None:
        self.fields: dict[str, object] = {}
        self._header = b""
        self._name: str | None = None
        self._value: list[bytes] = []
        self._size = 0

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._header = data[start:end].lower()

    def header_value(self, data: bytes, start: int, end: int) -> None:
        if self._header != b"content-disposition":
            return
        _, params = parse_options_header(data[start:end])
        if b"filename" not in params and b"name" in params:
            self._name = params[b"name"].decode("utf-8", "replace")

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name is None:
            return  # a file: walked over
        self._size += end - start
        if self._size > MAX_FIELD:
            raise BadRequest(f"form field '{self._name[:64]}' is longer than {MAX_FIELD} bytes")
        self._value.append(data[start:end])

    def part_end(self) -> None:
        if self._name is not None:
            self.fields[self._name] = b"".join(self._value).decode("utf-8", "replace")
        self._header, self._name, self._value, self._size = b"", None, [], 0


def form_fields(body: bytes, content_type: bytes) -> dict[str, object]:
    """The text fields of a multipart body, by name (the last of a repeated name wins)."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequest("multipart/form-data body without a boundary")
    fields = _Fields()
    parser = MultipartParser(boundary, {
        "on_header_field": fields.header_field, "on_header_value": fields.header_value,
        "on_part_data": fields.part_data, "on_part_end": fields.part_end,
    })
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError:
        raise BadRequest("request body is not valid multipart/form-data") from None
    return fields.fields
