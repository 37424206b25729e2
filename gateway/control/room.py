"""GPU memory for a wake or a start (issue 39): before an instance on declared GPUs is woken
or started, the latest NVML reading of each of its GPUs (``LoadReport.gpus``, scraped with
its instances' metrics) says how much memory is free. When its share (vLLM takes
``--gpu-memory-utilization`` of each GPU's memory) does not fit, awake instances on the
same GPU that demand may put to sleep or stop make room, least recently used first, never
one with requests in flight. Without readings (no NVML, no declared GPUs) nothing is done:
the shares in the config are then the only budget (``check`` refuses one that can never
fit, ``gateway.config.checks.gpu_budgets``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backends.backend import Backend, BackendState, GpuReading


def reading(backends: Sequence[Backend], gpu: int) -> GpuReading | None:
    """The latest NVML reading of ``gpu`` any backend's scrape brought."""
    for b in backends:
        if b.load is not None:
            for g in b.load.gpus:
                if g.index == gpu:
                    return g
    return None


def to_make_room(backends: Sequence[Backend], backend: Backend,
                 last_used: Callable[[Backend], float]) -> list[Backend]:
    """The awake instances to put to sleep (or stop) so that ``backend`` fits on its GPUs,
    least recently used first; empty when it fits, or when nothing says it does not."""
    spawn = backend.spec.spawn
    if spawn is None:
        return []
    chosen: list[Backend] = []
    for gpu in spawn.gpus:
        seen = reading(backends, gpu)
        if seen is None:
            continue
        short = spawn.gpu_share * seen.memory_total - (seen.memory_total - seen.memory_used)
        short -= sum(_share(b) * seen.memory_total for b in chosen if gpu in _gpus(b))
        for other in sorted((b for b in backends if _yields(b, backend, gpu)
                             and b not in chosen), key=last_used):
            if short <= 0:
                break
            chosen.append(other)
            short -= _share(other) * seen.memory_total
    return chosen


def _yields(other: Backend, backend: Backend, gpu: int) -> bool:
    spawn = other.spec.spawn
    return (other is not backend and spawn is not None and gpu in spawn.gpus
            and other.state is BackendState.READY and other.in_flight == 0
            and (spawn.sleep_after is not None or spawn.stop_after is not None))


def _share(b: Backend) -> float:
    return b.spec.spawn.gpu_share if b.spec.spawn is not None else 0.0


def _gpus(b: Backend) -> tuple[int, ...]:
    return b.spec.spawn.gpus if b.spec.spawn is not None else ()
