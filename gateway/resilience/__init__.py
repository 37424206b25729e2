"""What keeps clients served when backends fail: circuit breakers (and their openings shared
through Redis), the retry budget and back-off, the reply cache and the degraded answers
built from it, and the SSE folding they need.

Owns breaker state and the reply cache. May import ``http``, ``state``, ``upstream``, the
leaves and ``backends``; never ``routing``, ``canary`` or anything above them.
"""
