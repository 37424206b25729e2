"""The control process and its serving workers: one port, one core each, one owner of state.

With more than one serving process (``[gateway] workers``, "auto" by default), ``serve``
runs a control process that owns what must exist once: the embedded valkey, the health
probes, load scrapes and discovery of every backend, the spawned backends' supervisors and
every operator change of a backend's life (drain, restart, stop, start, reload). The
workers serve clients; each adopts the versioned ``snapshot`` the control process publishes
whole, and reports its in-flight counts back (which doubles as its heartbeat: a worker that
stops reporting is killed and replaced), so a drain waits for every worker's requests.
``role`` names the three kinds of process; ``link`` is a worker's side of the control
socket, ``server`` the control process's.

May import the leaves, ``backends``, and every room below the front door; only the front
door imports it.
"""
