"""A vLLM simulator: vLLM's HTTP shape with configurable timing and faults."""

from backends.sim.app import SimApp
from backends.sim.options import SimOptions

__all__ = ["SimApp", "SimOptions"]
