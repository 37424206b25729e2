"""KV-cache-aware routing (issue 38): vLLM's KV events decoded (``events``) into an index of
which backend holds which block (``index``). docs/KV-ROUTING.md has the design."""
