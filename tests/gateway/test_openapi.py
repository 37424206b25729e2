"""The OpenAPI document (GET /openapi.json) and the README name every route the gateway
answers or proxies."""

from __future__ import annotations

from pathlib import Path

import orjson

from gateway import __version__
from gateway.app import PROXIED, _openapi

REPO = Path(__file__).resolve().parents[2]
STORED = {"/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"}
OWN = {"/v1/models", "/v1/models/{model}", "/health", "/version", "/openapi.json", "/healthz",
       "/readyz", "/metrics", "/dashboard", "/admin/status", "/admin/reload", "/admin/keys",
       "/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
       "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel"}


def test_the_document_describes_every_proxied_and_own_route() -> None:
    document = orjson.loads(_openapi())
    assert document["info"]["version"] == __version__
    missing = (PROXIED | STORED | OWN) - set(document["paths"])
    assert missing == set()


def test_the_readme_lists_every_route() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [p for p in sorted(PROXIED | STORED | OWN) if f"`{p}`" not in readme
               and f"{p}`" not in readme]
    assert missing == []
