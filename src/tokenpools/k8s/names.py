"""Names and label values the operator derives from user-chosen names.

Kubernetes limits object names (a DNS subdomain: 253 characters) and label values (63, an
alphanumeric at each end). A derived name that would not fit keeps a readable prefix and ends
in a hash of the whole input, so it stays valid and two different inputs never share it.
"""

from __future__ import annotations

import hashlib
import re

_LABEL = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
SUBDOMAIN_MAX, LABEL_MAX = 253, 63


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fit(name: str, limit: int, whole: str) -> str:
    if len(name) <= limit:
        return name
    head = name[: limit - 17].rstrip("-.")
    return f"{head}-{_digest(whole)}"


def node_name(pool: str) -> str:
    """The virtual node of a (cluster-scoped, so unique) TokenPool."""
    return _fit(f"tokenpools-{pool}", SUBDOMAIN_MAX, pool)


def pod_name(entitlement: str) -> str:
    """The lease pod of an entitlement, in the entitlement's namespace."""
    return _fit(f"lease-{entitlement}", SUBDOMAIN_MAX, entitlement)


def label_value(text: str) -> str:
    """`text` when it is a valid label value, else a valid one unique to it."""
    if len(text) <= LABEL_MAX and _LABEL.match(text):
        return text
    head = re.sub(r"[^-A-Za-z0-9_.]", "-", text)[: LABEL_MAX - 17].strip("-_.")
    return f"{head}-{_digest(text)}" if head else _digest(text)


def entitlement_key(namespace: str, name: str) -> str:
    """An entitlement's name in the gateway's config: namespaces hold no '/', so this is
    unique across the cluster."""
    return f"{namespace}/{name}"
