"""Simulator options, and the per-request overrides carried in the ``x-sim`` header."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class Fault(enum.Enum):
    NONE = "none"
    ERROR = "500"  # HTTP 500 before any byte
    BUSY = "busy"  # HTTP 503 with Retry-After
    CRASH = "crash"  # drop the connection after `after` chunks
    INBAND = "inband"  # a `data: {"error": ...}` event after `after` chunks (HTTP 200)
    STALL = "stall"  # stop sending for `stall` seconds after `after` chunks
    CUT = "cut"  # whole reply: headers, `after` body bytes, then drop (a stream: as crash)


@dataclass(frozen=True, slots=True)
class SimOptions:
    models: tuple[str, ...] = ("sim-model",)
    # per-model overrides in the x-sim syntax, e.g. {"slow-model": "itl=0.25"}
    model_overrides: tuple[tuple[str, str], ...] = ()
    ttft: float = 0.0  # seconds before the first token
    itl: float = 0.0  # seconds between tokens
    tokens: int = 16  # output length when the request gives no max_tokens
    max_prompt_len: int = 0  # 0 = no limit; longer prompts get a 400
    error_rate: float = 0.0  # fraction of requests answered with 500
    busy_rate: float = 0.0  # fraction answered 503 + Retry-After
    retry_after: int = 1
    fault: Fault = Fault.NONE  # applied to every request
    after: int = 0  # chunks before CRASH / INBAND / STALL strikes
    stall: float = 3600.0
    split: int = 0  # bytes per write of a reply body or SSE event; 0 = one write each
    seed: int = 0
    # Requests generating at once (vLLM's --max-num-seqs); the others wait in the
    # simulator's own FIFO queue, as in vLLM's scheduler. 0 = no limit.
    capacity: int = 0
    # vLLM's KV-cache events (--kv-events-config): the endpoints the PUB and the replay
    # ROUTER bind ("": none), the block size and how many blocks the cache holds, and every
    # how many batches one is lost (kept for replays). --token-details: vLLM's
    # --enable-prompt-tokens-details (cached tokens in each reply's usage).
    kv_events: str = ""
    kv_replay: str = ""
    kv_block: int = 16
    kv_blocks: int = 200_000
    kv_drop: int = 0
    token_details: bool = False
    # Prompt tokens the instance prefills a second, one prompt after another (its uncached
    # tokens only): a request's first token waits for the prefill queued before it and its
    # own, which makes a cache hit faster and a hot instance slower. 0: no prefill time.
    prefill_rate: float = 0.0
    # vLLM's sleep mode (backends/sim/sleep.py): its dev routes (VLLM_SERVER_DEV_MODE=1),
    # --enable-sleep-mode, seconds a wake takes, and the fault of wrong answers after a wake.
    dev_mode: bool = False
    sleep_mode: bool = False
    wake_delay: float = 0.0
    wake_garbles: bool = False
    # LoRA (backends/sim/lora.py): --enable-lora, --max-loras, and the runtime load and
    # unload routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).
    enable_lora: bool = False
    max_loras: int = 1
    runtime_lora: bool = False
    lora_delay: float = 0.0

    @classmethod
    def parse_model(cls, spec: str) -> tuple[str, str]:
        """``NAME`` or ``NAME:key=value,...`` (the x-sim syntax) -> (name, overrides)."""
        name, _, overrides = spec.partition(":")
        if overrides:
            cls().override(overrides)  # fail early on a bad key
        return name, overrides

    def for_model(self, model: str) -> SimOptions:
        for name, overrides in self.model_overrides:
            if name == model:
                return self.override(overrides)
        return self

    def override(self, header: str) -> SimOptions:
        """Apply ``key=value`` pairs (comma or semicolon separated) from the x-sim header."""
        changes: dict[str, object] = {}
        for item in header.replace(";", ",").split(","):
            key, _, value = item.strip().partition("=")
            if not key:
                continue
            if key == "fault":
                changes["fault"] = Fault(value)
            elif key in ("ttft", "itl", "stall", "error_rate", "busy_rate"):
                changes[key] = float(value)
            elif key in ("tokens", "after", "retry_after", "max_prompt_len", "split"):
                changes[key] = int(value)
            else:
                raise ValueError(f"unknown x-sim key {key!r}")
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
