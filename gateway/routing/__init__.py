"""Which backend takes a request: the pool (the one owner of the backends and of the
``[[models]]`` map), the candidate filter, session pins in Redis, consistent hashing, and
one routing policy per module under ``policies``.

Owns the backend list and the model map; a reload changes them through ``BackendPool``.
May import ``resilience``, ``state``, ``http``, the leaves and ``backends``; never ``canary``
or anything above it.
"""
