"""Backends found by DNS: a ``[[backends]]`` entry with ``discover`` instead of ``url`` stands
for every address its name resolves to (a Kubernetes headless Service lists one per ready
pod). Each address becomes a backend of the entry's group named ``NAME-ADDRESS`` (stable
while the address is), reached at ``http://ADDRESS:PORT``.

``dns://NAME:PORT`` asks the host's resolvers; ``dns://SERVER[:DNSPORT]/NAME:PORT`` asks
that server (RFC 4501's authority form). A lookup that fails keeps the addresses found last,
so a DNS outage never empties the pool; a name that no longer exists (NXDOMAIN) or has no
address empties it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import dns.asyncresolver
import dns.exception
import dns.resolver

from backends.spec import BackendSpec, DnsTarget

log = logging.getLogger("backends.discovery")


def member(template: BackendSpec, address: str, port: int) -> BackendSpec:
    """The backend one address of ``template`` stands for."""
    host = f"[{address}]" if ":" in address else address
    return template.model_copy(update={"name": f"{template.name}-{address.replace(':', '_')}",
                                       "url": f"http://{host}:{port}", "discover": None})


Told = Callable[[], Mapping[str, list[str]]]


class Discovery:
    """Expands discover entries into backends, remembering each name's last good answer.
    ``told``: instead of asking DNS, take each entry's addresses from another's answers
    (a serving worker, from its control process's snapshot: one lookup per replica)."""

    def __init__(self, timeout: float = 2.0, told: Told | None = None) -> None:
        self._timeout = timeout
        self._told = told
        self._last: dict[str, list[str]] = {}

    def found(self) -> dict[str, list[str]]:
        """Each entry's addresses as last found."""
        return dict(self._last)

    async def expand(self, specs: tuple[BackendSpec, ...] | list[BackendSpec]) -> list[BackendSpec]:
        out: list[BackendSpec] = []
        for spec in specs:
            if spec.discover is None:
                out.append(spec)
                continue
            target = DnsTarget.parse(spec.discover)
            addresses = await self._addresses(spec.name, target)
            out += [member(spec, a, target.port) for a in addresses]
        return out

    async def _addresses(self, entry: str, target: DnsTarget) -> list[str]:
        if self._told is not None:
            return list(self._told().get(entry, ()))
        resolver = dns.asyncresolver.Resolver(configure=target.server is None)
        if target.server is not None:
            resolver.nameservers = [target.server]
            resolver.port = target.server_port
        resolver.lifetime = self._timeout
        found: list[str] = []
        try:
            for kind in ("A", "AAAA"):
                try:
                    answer = await resolver.resolve(target.name, kind, search=False)
                except dns.resolver.NoAnswer:
                    continue
                found += [r.to_text() for r in answer]
        except dns.resolver.NXDOMAIN:
            found = []
        except (dns.exception.DNSException, OSError) as exc:
            kept = self._last.get(entry, [])
            log.warning("backend %s: looking up %s failed (%s); keeping its %d addresses",
                        entry, target.name, type(exc).__name__, len(kept))
            return kept
        found = sorted(set(found), key=lambda a: (":" in a, a))
        if found != self._last.get(entry):
            log.warning("backend %s: %s resolves to %s", entry, target.name, found or "nothing")
        self._last[entry] = found
        return found
