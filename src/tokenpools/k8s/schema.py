"""The custom resources' specs: the config file's pydantic schema plus what only a cluster has.

TokenPool is cluster-scoped and belongs to the platform: its spec is a `pools[]` entry without
`name` (metadata.name), with the workload to scale, the namespaces whose entitlements may use
it, backends whose credentials come from Secrets in the platform's namespace, and the
InferencePool its llm-d InferenceObjectives point at. A cluster
pool names no file: no `apiKeyFile`, no `apiKeyEnv`, no tokenizer path.

TokenEntitlement is namespaced and belongs to its tenant, which *is* its namespace: its spec
is an `entitlements[]` entry without `name` and `tenantId`, with the SHA-256 hashes of its API
keys in the spec (`apiKeyHashes`), so nothing a tenant writes makes a component read a Secret.

TokenBudget is cluster-scoped and belongs to the platform (no tenant may raise its own): its
spec is a `budgets[]` entry without `name`; a tenant is a namespace, an entitlement
`<namespace>/<name>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenpools.model.config_schema import ProfileSpec
from tokenpools.model.keys import KEY_HASH_PATTERN

GROUP = "tokenpools.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
POOL_PLURAL, ENTITLEMENT_PLURAL = "tokenpools", "tokenentitlements"
BUDGET_PLURAL = "tokenbudgets"
KeyHash = Annotated[str, Field(pattern=KEY_HASH_PATTERN, max_length=71)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SelectorRequirement(_Strict):
    key: Annotated[str, Field(min_length=1)]
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = []


class LabelSelector(_Strict):
    """A Kubernetes label selector; `{}` selects every namespace."""

    matchLabels: dict[str, str] = {}
    matchExpressions: list[SelectorRequirement] = []

    def matches(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.matchLabels.items()):
            return False
        for req in self.matchExpressions:
            has, value = req.key in labels, labels.get(req.key)
            ok = {
                "In": has and value in req.values,
                "NotIn": not has or value not in req.values,
                "Exists": has,
                "DoesNotExist": not has,
            }[req.operator]
            if not ok:
                return False
        return True


class ScaleTargetRef(_Strict):
    """The serving workload, in the platform's namespace; any resource with a scale
    subresource (a Deployment usually)."""

    apiVersion: str = "apps/v1"
    kind: Literal["Deployment", "StatefulSet"] = "Deployment"
    name: Annotated[str, Field(min_length=1, max_length=253)]


# a Kubernetes object name (a DNS subdomain), as an InferenceObjective's poolRef takes it
OBJECT_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class InferencePoolRef(_Strict):
    """The Gateway API Inference Extension InferencePool in front of the pool's replicas, in
    the platform's namespace: an InferenceObjective names a pool of its own namespace, and the
    operator writes objectives there only. Absent: an InferencePool named as the TokenPool."""

    # v1 (inference.networking.k8s.io); the alpha group for an older extension's pools
    group: Literal["inference.networking.k8s.io", "inference.networking.x-k8s.io"] = (
        "inference.networking.k8s.io"
    )
    name: Annotated[str, Field(min_length=1, max_length=253, pattern=OBJECT_NAME)]


class Autoscaling(_Strict):
    # publish: desired replicas in status and /metrics, for HPA or KEDA to act on (the
    # workload has one owner); write: the operator writes the workload's /scale itself
    mode: Literal["publish", "write"] = "publish"
    cooldownS: Annotated[float, Field(ge=0)] = 60.0  # between two writes of the same pool


class SecretKeyRef(_Strict):
    """A key of a Secret in the platform's namespace (the gateway's own)."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    key: Annotated[str, Field(min_length=1)] = "apiKey"


class ClusterBackend(_Strict):
    url: Annotated[str, Field(pattern=r"^https?://[^/\s]+(/.*)?$")]
    timeoutS: Annotated[float, Field(gt=0)] = 600.0
    model: Annotated[str, Field(min_length=1)] | None = None
    apiKeySecretRef: SecretKeyRef | None = None


# The config file's `model` is a built-in profile's name or a profile mapping. The API server
# types a field one way only, and its CEL reads typed fields only (a field with no type is left
# out of CEL, and a rule that reads it does not compile: tests/test_k8s_cel_types.py), so a
# TokenPool says the name in `model` (a string) and a profile of its own in `customModel`.
ModelName = Annotated[str, Field(min_length=1, max_length=253)]


class ModelChoice(_Strict):
    """A TokenPool's `model` or `customModel`: exactly one (also a CEL rule of the CRD)."""

    model: ModelName | None = None
    customModel: ProfileSpec | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelChoice:
        if (self.model is None) == (self.customModel is None):
            raise ValueError("give model (a built-in profile) or customModel, one of the two")
        return self

    def config_value(self) -> str | dict[str, Any]:
        """The config file's `model`."""
        if self.customModel is not None:
            return self.customModel.model_dump()
        assert self.model is not None
        return self.model


class PoolExtras(_Strict):
    model: ModelName | None = None  # a built-in profile's name (ModelChoice)
    customModel: ProfileSpec | None = None  # or a profile of its own
    # which namespaces' entitlements may use the pool: none when absent (as Kueue's
    # ClusterQueue), every namespace for {}
    namespaceSelector: LabelSelector | None = None
    scaleTargetRef: ScaleTargetRef | None = None
    autoscaling: Autoscaling = Autoscaling()
    # the node shrinks only after ready replicas stay lower this long (a rolling update's dip
    # must not evict guaranteed leases); it grows at once
    capacityShrinkAfterS: Annotated[float, Field(ge=0)] = 60.0
    backends: list[ClusterBackend] = []
    tokenizer: Literal["estimate", "backend"] = "estimate"
    # the picker's pool the operator's InferenceObjectives point at (k8s/inference_objectives.py)
    inferencePoolRef: InferencePoolRef | None = None


class EntitlementExtras(_Strict):
    # bounded, so the API server can bound the cost of the CEL rule over it
    apiKeyHashes: Annotated[list[KeyHash], Field(max_length=64)] = []


# Fields of the file schema a cluster gives otherwise (metadata, namespace, the extras above).
POOL_REPLACED = ("name", "model", "backends", "tokenizer")
ENTITLEMENT_REPLACED = ("name", "apiKeys", "tenantId")
BUDGET_REPLACED = ("name",)


class BudgetExtras(_Strict):
    """A TokenBudget has nothing a `budgets[]` entry lacks but its name (metadata.name)."""


def split(
    spec: Mapping[str, Any], extras: type[BaseModel]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A CR spec → (the file-schema part, the cluster-only part)."""
    own = set(extras.model_fields)
    return {k: v for k, v in spec.items() if k not in own}, {
        k: v for k, v in spec.items() if k in own
    }
