"""The operators' API and tools: backend actions (drain, restart, stop, start), canary
verbs, config hot reload, and the command-line client that calls them.

Owns nothing of its own: it acts through the owners below (pool, supervisors, breakers,
canary). May import every other subpackage; only the front door (``app``, ``cli``,
``proxy``) imports it.
"""
