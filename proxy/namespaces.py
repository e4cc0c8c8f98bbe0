"""Tenant and namespace: the one naming rule of threadkeeper's local state (SPEC section 1).

- A **tenant** is a policy file (`acme`, `default`). Metrics label by tenant only, so
  their cardinality stays the number of policy files.
- A **namespace** is where a caller's state is stored: the tenant's id for a key a policy
  lists, `<tenant>:<caller hash>` for a passthrough caller (a key no policy lists, served
  by `default` with `allow_unknown_keys: true`). Callers never see each other's
  namespaces.

Everything that shows stored state names both (`fields`): the request log lines, the CLI's
and the inspector's records. A tenant filter (`--tenant default`, the inspector's tenant
field) matches the tenant's own namespace and every passthrough caller's under it; a
namespace filter (`--namespace default:<hash>`) matches that one alone (`Scope`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# ":" cannot appear in a tenant id (policy.Tenant), so no keyed tenant shares a caller's
# namespace. Domain-separated so the stored value is not the hash a policy file lists.
SEPARATOR = ":"
CALLER_HASH_PREFIX = b"threadkeeper-caller-namespace\x00"


def caller_hash(token: str | None) -> str:
    """128 bits of a domain-separated sha256 of the caller's key ("" when it sent none)."""
    data = CALLER_HASH_PREFIX + (token or "").encode("utf-8", "surrogateescape")
    return hashlib.sha256(data).hexdigest()[:32]


def caller_namespace(tenant: str, token: str | None) -> str:
    """The namespace of a passthrough caller of `tenant` with this key."""
    return f"{tenant}{SEPARATOR}{caller_hash(token)}"


def tenant_of(namespace: str) -> str:
    """The tenant (policy file) a namespace belongs to."""
    return namespace.partition(SEPARATOR)[0]


def is_caller(namespace: str) -> bool:
    """Whether the namespace is a passthrough caller's rather than a keyed tenant's."""
    return SEPARATOR in namespace


def caller_prefix(tenant: str) -> str:
    """What every passthrough caller's namespace under `tenant` starts with."""
    return f"{tenant}{SEPARATOR}"


def fields(namespace: str) -> dict[str, str]:
    """How a record, a log line or a page names where some state lives."""
    return {"tenant": tenant_of(namespace), "namespace": namespace}


def label(namespace: str) -> str:
    """The words a page or a CLI line names a namespace with."""
    if is_caller(namespace):
        return f"tenant {tenant_of(namespace)} · passthrough caller {namespace}"
    return f"tenant {namespace}"


@dataclass(frozen=True)
class Scope:
    """An operator's filter: `namespace` exactly, else every namespace of `tenant`, else
    everything."""

    tenant: str | None = None
    namespace: str | None = None

    def __post_init__(self) -> None:
        if self.tenant is not None and SEPARATOR in self.tenant:
            raise ValueError(
                f"{self.tenant!r} is a namespace, not a tenant: filter by namespace instead"
            )
        if (
            self.tenant is not None
            and self.namespace is not None
            and tenant_of(self.namespace) != self.tenant
        ):
            raise ValueError(
                f"namespace {self.namespace!r} does not belong to tenant {self.tenant!r}"
            )

    def matches(self, namespace: str) -> bool:
        if self.namespace is not None:
            return namespace == self.namespace
        return self.tenant is None or tenant_of(namespace) == self.tenant

    def describe(self) -> str:
        if self.namespace is not None:
            return f"namespace {self.namespace!r}"
        if self.tenant is not None:
            return f"tenant {self.tenant!r} (its passthrough callers included)"
        return "any tenant"
