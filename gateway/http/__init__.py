"""The HTTP edge: the server's own limits on connections and headers, ASGI helpers and
request ids, API-key auth and the record of refused keys, which headers cross the gateway and
who the client is, the media URL policy, per-request deadlines, HTTP/1.0 framing and the
reply rewrite that gives clients their own model name back.

Owns little state: the bytes of request bodies held (``BodyBudget``) and the refusals' log
pace. May import the leaves (``gateway.config``, ``errors``, ``types``,
``metrics``) and ``backends``; nothing else of the gateway.
"""
