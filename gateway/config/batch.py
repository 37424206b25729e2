"""``[batch]``: the Files and Batches APIs (``gateway.batch``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MIB = 1 << 20


class BatchSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="serve /v1/files and /v1/batches")
    dir: str = Field(default="", description="where files and results are kept (a "
                     "shared volume for several replicas); empty: `batch` beside [redis] "
                     "data_dir")
    max_file_bytes: int = Field(default=200 * MIB, ge=1, description="one upload, at most")
    max_lines: int = Field(default=50_000, ge=1, description="lines of one batch, at most")
    max_open_batches: int = Field(default=10, ge=1, description="per key, not yet ended")
    max_stored_bytes: int = Field(default=2048 * MIB, ge=1,
                                  description="bytes of files one key keeps, at most")
    concurrency: int = Field(default=8, ge=1, le=1024,
                             description="batch lines in flight at once, at most")
