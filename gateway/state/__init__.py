"""Shared state's transport: the one Redis link of a process (auto-pipelined, bounded,
never fatal) and the embedded valkey-server the gateway can start and supervise.

Owns the Redis connection and the embedded server's data directory. May import the leaves
and ``backends``; nothing else of the gateway. What is stored (pins, arms, breaker openings,
replies, canary state) belongs to the packages above that use the link.
"""
