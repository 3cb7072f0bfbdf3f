"""A pool's llm-d InferenceObjectives, as manifests (pure builders, no I/O).

One objective per service class: named `objective_name(pool, class)`, the name the ext_proc
processor sends in `x-llm-d-inference-objective`, with the class's llm-d priority (both from
model/objectives.py), pointing at the InferencePool whose endpoint picker reads it. llm-d's
picker serves higher priorities first and may shed negative ones; within a priority it shares
by the flow's fairness id, which the processor sets to the tenant.

Every pool gets all five classes, whatever entitlements it has today: the set depends on the
pool alone, so a tenant's new entitlement never waits for its objective, and no admitted
request names an objective the picker lacks — llm-d files such a request at the default
priority 0, which would lift spot and preemptible work into elastic's band.

`tokenpools k8s render` and the operator (k8s/objective_sync.py) both build them here; the
labels let the operator adopt what `render` applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenpools.k8s.api import Kind
from tokenpools.k8s.names import label_value
from tokenpools.k8s.objects import POOL_LABEL
from tokenpools.k8s.schema import API_VERSION, InferencePoolRef
from tokenpools.model.objectives import PRIORITY, objective_name
from tokenpools.model.service_class import ServiceClass

KIND = "InferenceObjective"
PLURAL = "inferenceobjectives"
# llm-d's router (the endpoint picker's home since mid-2026) serves the kind in llm-d.ai; the
# Gateway API Inference Extension's releases before the move served it in
# inference.networking.x-k8s.io, which llm-d still reads where its own group is not installed.
LLM_D = "llm-d.ai/v1alpha2"
LEGACY = "inference.networking.x-k8s.io/v1alpha2"
API_VERSIONS = (LLM_D, LEGACY)  # the operator writes to the first one the cluster serves
DEFAULT_POOL_GROUP = InferencePoolRef.model_fields["group"].default
MANAGED_BY = {"app.kubernetes.io/managed-by": "tokenpools"}
CLASS_LABEL = "tokenpools.io/service-class"


def objective_kind(api_version: str) -> Kind:
    return Kind(api_version, PLURAL)


def inference_objectives(
    pool: str,
    namespace: str,
    ref: InferencePoolRef | None = None,
    api_version: str = LLM_D,
    owner: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The pool's objectives, one per class, in `namespace` (the InferencePool's own);
    `owner`, the TokenPool as the API server returned it (its uid), makes them the pool's."""
    # by default the InferencePool named as the pool (a name a config file gives is not
    # checked here: `render` emits the TokenPool under that very name)
    group, target = (ref.group, ref.name) if ref else (DEFAULT_POOL_GROUP, pool)
    out = []
    for service_class in ServiceClass:
        meta: dict[str, Any] = {
            "name": objective_name(pool, service_class),
            "namespace": namespace,
            "labels": {
                **MANAGED_BY,
                POOL_LABEL: label_value(pool),
                CLASS_LABEL: service_class.value,
            },
        }
        if owner is not None:
            meta["ownerReferences"] = [owner_reference(owner)]
        out.append(
            {
                "apiVersion": api_version,
                "kind": KIND,
                "metadata": meta,
                "spec": {
                    "priority": PRIORITY[service_class],
                    # the group set, not defaulted: llm-d ignores an objective whose group is
                    # not its InferencePool's, and the CRD's default has changed before
                    "poolRef": {"group": group, "kind": "InferencePool", "name": target},
                },
            }
        )
    return out


def owner_reference(pool: Mapping[str, Any]) -> dict[str, Any]:
    """A namespaced objective owned by the cluster-scoped TokenPool (allowed that way round):
    the garbage collector removes it with the pool. No blockOwnerDeletion: setting it needs
    the right to update the pool's finalizers, which the operator does not hold."""
    meta = pool["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": "TokenPool",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }
