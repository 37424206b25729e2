"""The chaos soak (``python -m bench.chaos``): the whole system under random faults while
official-SDK clients work, and a report of what users would ask: was anything lost,
silently truncated, duplicated or hung.

``stack`` starts the processes, ``clients`` drives the load and records each request as the
client saw it, ``faults`` breaks things at random (seeded, each fault bounded), ``verdict``
reads the records against the fault log and writes the report.
"""
