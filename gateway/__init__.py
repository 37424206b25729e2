"""vllm-gateway: the request path in front of several vLLM backends."""

__version__ = "0.1.0"
