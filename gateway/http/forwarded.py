"""Who the client is: the peer, unless the peer is a proxy the operator trusts.

A client's own ``X-Forwarded-For``, ``Forwarded`` and ``X-Real-IP`` never reach a backend:
upstream gets ``X-Forwarded-For`` with what the gateway saw. When the peer is in
``[gateway] trusted_proxies`` (addresses or networks), the chain it sent is kept and the
peer appended, and the client the gateway believes is the first address from the right
that is not a trusted proxy (the access log's ``client``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Headers = list[tuple[bytes, bytes]]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
FORWARDING = frozenset({b"x-forwarded-for", b"forwarded", b"x-real-ip"})
MAX_HOPS = 16  # a longer chain is cut to its last hops


class Forwarding:
    def __init__(self, trusted: Sequence[object]) -> None:
        """``trusted``: addresses or networks (strings or ``ipaddress`` objects)."""
        self._nets: list[Network] = [ipaddress.ip_network(str(t), strict=False)
                                     for t in trusted]

    def trusts(self, address: str) -> bool:
        if not self._nets:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self._nets)

    def client(self, peer: str, headers: Headers) -> tuple[str, bytes]:
        """The client the gateway believes, and the ``X-Forwarded-For`` to send upstream."""
        if not self.trusts(peer):
            return peer, peer.encode()
        hops = [hop.strip() for key, value in headers if key == b"x-forwarded-for"
                for hop in value.decode("latin-1").split(",") if hop.strip()][-MAX_HOPS:]
        client = peer
        for hop in reversed(hops):
            client = hop
            if not self.trusts(hop):
                break
        return client, ", ".join([*hops, peer]).encode("latin-1")
