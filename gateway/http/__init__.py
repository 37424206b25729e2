"""The HTTP edge: ASGI helpers and request ids, API-key auth, which headers cross the
gateway, per-request deadlines, HTTP/1.0 framing and the reply rewrite that gives clients
their own model name back.

Owns nothing stateful. May import the leaves (``gateway.config``, ``errors``, ``types``,
``metrics``) and ``backends``; nothing else of the gateway.
"""
