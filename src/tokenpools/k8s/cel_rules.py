"""The CRDs' CEL rules (`x-kubernetes-validations`, Kubernetes ≥ 1.25; all GA by 1.30): what the
API server can refuse on its own, before anything is stored. Each rule restates a check of the
config schema with the schema's own data (the built-in profiles, the key hash pattern), and
tests/test_k8s_cel.py evaluates every rule against the pydantic models on generated cases.
What CEL cannot see (another object: the pool, the namespace, other entitlements' keys) is the
webhook's (k8s/webhook.py)."""

from __future__ import annotations

import json
from typing import Any

from tokenpools.model.keys import KEY_HASH_PATTERN
from tokenpools.model.profile import BUILTIN_PROFILES


def _rule(rule: str, message: str, reason: str = "FieldValueInvalid") -> dict[str, str]:
    return {"rule": rule, "message": message, "reason": reason}


def _or(field: str, default: int) -> str:
    return f"(has(self.{field}) ? self.{field} : {default})"


_PROFILES = json.dumps(sorted(BUILTIN_PROFILES))
_QUANTITY_ONE_KV = _rule(
    "!(has(self.kvCacheGiB) && has(self.kvTokens))", "give kvCacheGiB or kvTokens, not both"
)

POOL_SPEC: list[dict[str, str]] = [
    # `model` is typed (a string): CEL reads typed fields only (tests/test_k8s_cel_types.py)
    _rule(
        "has(self.model) != has(self.customModel)",
        "give model (a built-in profile) or customModel, one of the two",
        "FieldValueRequired",
    ),
    _rule(
        f"!has(self.model) || self.model in {_PROFILES}",
        f"model must be one of the built-in profiles {_PROFILES}; a profile of its own goes "
        "in customModel",
    ),
    _rule(
        f"{_or('minReplicas', 0)} <= {_or('replicas', 1)} && "
        f"(!has(self.maxReplicas) || {_or('replicas', 1)} <= self.maxReplicas)",
        "need minReplicas <= replicas <= maxReplicas",
    ),
    _rule(
        "has(self.perReplica.tokensPerSecond) && has(self.perReplica.concurrency)",
        "perReplica needs tokensPerSecond and concurrency",
        "FieldValueRequired",
    ),
    _rule(
        "has(self.perReplica.kvCacheGiB) || has(self.perReplica.kvTokens)",
        "perReplica needs kvCacheGiB or kvTokens",
        "FieldValueRequired",
    ),
]
POOL_FIELDS: dict[str, list[dict[str, str]]] = {"perReplica": [_QUANTITY_ONE_KV]}

ENTITLEMENT_SPEC: list[dict[str, str]] = [
    _QUANTITY_ONE_KV,
    _rule(
        f"!has(self.apiKeyHashes) || self.apiKeyHashes.all(h, h.matches('{KEY_HASH_PATTERN}'))",
        "apiKeyHashes holds 'sha256:' + 64 lower-case hex digits (`tokenpools hash-key`)",
    ),
]
ENTITLEMENT_FIELDS: dict[str, list[dict[str, str]]] = {
    # moving an entitlement to another pool is a new entitlement (a new lease, a new binding)
    "pool": [_rule("self == oldSelf", "pool is immutable; create a new entitlement")],
}


def attach(spec: dict[str, Any], whole: list[dict[str, str]], fields: dict[str, Any]) -> None:
    spec["x-kubernetes-validations"] = whole
    for name, rules in fields.items():
        spec["properties"][name]["x-kubernetes-validations"] = rules
