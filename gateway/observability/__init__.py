"""What operators see: the access log and request metrics, log set-up, and the status page
with its data.

Owns nothing the request path reads. May import ``canary``, ``routing``, ``resilience`` and
everything below them; never ``admin`` or the front door.
"""
