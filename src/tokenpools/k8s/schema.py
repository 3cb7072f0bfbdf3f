"""The custom resources' specs: the config file's pydantic schema plus what only a cluster has.

TokenPool.spec is a `pools[]` entry without `name` (metadata.name) and with the workload to
scale; TokenEntitlement.spec is an `entitlements[]` entry without `name` and with API keys
taken from Secrets instead of `apiKeys`. Both are validated by the same pydantic models.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

GROUP = "tokenpools.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
POOL_PLURAL, ENTITLEMENT_PLURAL = "tokenpools", "tokenentitlements"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScaleTargetRef(_Strict):
    """The serving workload; any resource with a scale subresource (a Deployment usually)."""

    apiVersion: str = "apps/v1"
    kind: str = "Deployment"
    name: Annotated[str, Field(min_length=1)]


class Autoscaling(_Strict):
    cooldownS: Annotated[float, Field(ge=0)] = 60.0  # between two changes of the same pool


class PoolExtras(_Strict):
    scaleTargetRef: ScaleTargetRef | None = None
    autoscaling: Autoscaling = Autoscaling()


class SecretKeyRef(_Strict):
    """A Secret's key holding API keys, one per line: plain keys or `sha256:` hashes."""

    name: Annotated[str, Field(min_length=1)]
    key: Annotated[str, Field(min_length=1)] = "apiKeys"


class EntitlementExtras(_Strict):
    apiKeySecretRefs: list[SecretKeyRef] = []


# Fields of the file schema that metadata or Secrets give in a cluster.
POOL_FROM_METADATA = ("name",)
ENTITLEMENT_FROM_METADATA = ("name", "apiKeys")


def split(spec: dict[str, Any], extras: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A CR spec → (the file-schema part, the cluster-only part)."""
    own = set(extras.model_fields)
    return {k: v for k, v in spec.items() if k not in own}, {
        k: v for k, v in spec.items() if k in own
    }
