"""API keys and the tenant each names: ``[[keys]]`` entries and the flat ``api_keys`` list.

A presented key is compared with every configured key, plain ones as they are and digests
(``sha256:HEX``) against the presented key's digest, so the time taken says nothing about
which matched. The tenant's name, never its key, is what logs and metrics show.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import SecretStr

from gateway.config.tenancy import KeySpec

DIGEST = "sha256:"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    models: frozenset[str] = frozenset()  # allowed (client names); empty: all
    priority: int = 0
    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0
    # What owns the files and batches it makes (``who``): its name, or for a key of the
    # flat list, whose name is its place there (a place another key may take after an
    # edit), a digest of the key itself.
    owner: str = ""

    @property
    def who(self) -> str:
        return self.owner or self.name

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent)

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


ANONYMOUS = Tenant("anonymous")  # every caller of a gateway without keys
FLAT_OWNER = "api_keys#"


def flat_owner(key: str) -> str:
    """A flat-list key's owner: stable wherever it moves in the list, and not the key."""
    digest = hashlib.blake2b(key.encode(), digest_size=10, person=b"vgw-batch-owner")
    return FLAT_OWNER + digest.hexdigest()


def _tenant(spec: KeySpec) -> Tenant:
    return Tenant(spec.name, frozenset(spec.models), spec.priority, spec.rpm, spec.tpm,
                  spec.max_concurrent)


class Keyring:
    def __init__(self, keys: Sequence[KeySpec] = (), flat: Sequence[SecretStr] = ()) -> None:
        self.replace(keys, flat)

    def replace(self, keys: Sequence[KeySpec], flat: Sequence[SecretStr] = ()) -> None:
        """Take the keys of a reloaded config (every holder of this keyring sees them at
        once; a request already admitted keeps its tenant)."""
        entries = [(s.get_secret_value(), Tenant(f"api_keys.{i}",
                                                  owner=flat_owner(s.get_secret_value())))
                   for i, s in enumerate(flat)]
        entries += [(spec.key.get_secret_value(), _tenant(spec)) for spec in keys]
        self._plain = [(k.encode(), t) for k, t in entries if not k.startswith(DIGEST)]
        self._digests = [(k[len(DIGEST):].encode(), t) for k, t in entries
                         if k.startswith(DIGEST)]
        self.tenants = {t.name: t for _, t in entries}
        self.owners = {t.who: t for _, t in entries}

    def name_of(self, owner: str) -> str:
        """The name of the key that owns what ``owner`` made (for views and accounting;
        a flat key no longer configured is ``api_keys.removed``, never its digest)."""
        tenant = self.owners.get(owner)
        if tenant is not None:
            return tenant.name
        return "api_keys.removed" if owner.startswith(FLAT_OWNER) else owner

    @classmethod
    def of(cls, keys: Sequence[str]) -> Keyring:
        """Plain keys, named ``api_keys.N`` (as the flat list is)."""
        return cls(flat=[SecretStr(k) for k in keys])

    @property
    def open(self) -> bool:
        """No key configured: anyone may call."""
        return not self.tenants

    def match(self, presented: bytes) -> Tenant | None:
        """The tenant whose key was presented, or None."""
        found = None
        for key, tenant in self._plain:
            if hmac.compare_digest(presented, key):
                found = tenant
        if self._digests:
            digest = hashlib.sha256(presented).hexdigest().encode()
            for key, tenant in self._digests:
                if hmac.compare_digest(digest, key):
                    found = tenant
        return found if presented else None
