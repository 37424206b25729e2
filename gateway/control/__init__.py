"""The control process and its serving workers: one port, one core each, one owner of state.

With more than one serving process (``[gateway] workers``, "auto" by default), ``serve``
runs a control process that owns what must exist once: the embedded valkey, the health
probes, load scrapes and discovery of every backend, the spawned backends' supervisors and
every operator change of a backend's life (drain, restart, stop, start, reload). The
workers serve clients; each adopts the versioned ``snapshot`` the control process publishes
whole, and reports its in-flight counts back (which doubles as its heartbeat: a worker that
stops reporting is killed and replaced), so a drain waits for every worker's requests.
``process`` is the control process itself, ``role`` names the three kinds of process,
``server`` holds the control process's table of its workers and the socket's routes,
``snapshot`` what it publishes, and ``link`` a worker's side of the socket. The workers'
own entry is ``gateway.workers``.

Part of the front door, below ``build`` (which builds its parts) and ``cli`` (which hands
the control process what ``build`` and the lifespan made: ``process.Plane``).
"""
