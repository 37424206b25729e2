"""vLLM backends: their specs, runtime state, health checks and the simulator.

This package never imports ``gateway``.
"""
