"""Whether a pod is a lease pod the operator made, exactly as it makes them: the proof behind
Bound (pure, no I/O).

Anyone who may create pods in a tenant namespace (a tenant with `edit`) can give a pod any
name, labels, owner references and containers. Two things stand between such a pod and a
binding. Admission: the `tokenpools-lease-pods` policy (deploy/base/admission-policy.yaml) lets
only the operator's service account put the lease label, the made-by annotation or a
TokenEntitlement owner on a pod, or give one a `tokenpools-*` PriorityClass or a
`tokenpools.io/*` resource in any container kind. And this check, so that the operator takes
none of that on trust: a pod counts only when it is what `objects.lease_pod` builds for the
entitlement — its label and owner, made by this installation, one pause container and nothing
else (no init, sidecar or ephemeral container), tokenpools.io/* requests equal to limits (other
resources, which a LimitRange or a mutating webhook may set, are not looked at), the class's
PriorityClass (and priority, once admission has set it), and a name whose digest matches the
class and requests it carries. Whether it is bound, and to which node, is the caller's.

A pod without the made-by annotation was made by an earlier version of the operator: it is
accepted when everything else holds, because its PriorityClass and requests are ones only the
operator was ever allowed to ask for."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tokenpools.control.placement import PRIORITY_CLASSES, RESOURCE_PREFIX
from tokenpools.k8s import objects as o
from tokenpools.k8s import quantity as q
from tokenpools.model.service_class import ServiceClass

_BY_PRIORITY_CLASS = {pc.name: (cls, pc.value) for cls, pc in PRIORITY_CLASSES.items()}
_PAUSE = o.PAUSE_IMAGE.rsplit(":", 1)[0] + ":"  # any pause tag an earlier version used


@dataclass(frozen=True)
class Lease:
    """What a genuine lease pod holds."""

    service_class: ServiceClass
    requests: Mapping[str, int]  # the tokenpools.io/* resources


def other_installation(pod: Mapping[str, Any], installation: str) -> bool:
    """Made by another installation of tokenpools: not ours to count, nor to delete."""
    annotations = pod["metadata"].get("annotations") or {}
    made_by = annotations.get(o.MADE_BY_ANNOTATION)
    return made_by is not None and made_by != installation


def proof(
    pod: Mapping[str, Any], owner_uid: str, owner_name: str, installation: str
) -> Lease | str:
    """The lease the pod holds for entitlement (owner_uid, owner_name), or why it is not one."""
    meta, spec = pod["metadata"], pod.get("spec") or {}
    if (meta.get("labels") or {}).get(o.LEASE_LABEL) != "true":
        return "it has no lease label"
    if o.owner_uid(pod) != owner_uid:
        return "it is not owned by the entitlement"
    if other_installation(pod, installation):
        return "another installation made it"
    found = _BY_PRIORITY_CLASS.get(str(spec.get("priorityClassName")))
    if found is None:
        return "its PriorityClass is not a service class's"
    service_class, value = found
    if spec.get("priority") is not None and spec["priority"] != value:
        return f"its priority {spec['priority']} is not its class's {value}"
    if spec.get("initContainers") or spec.get("ephemeralContainers"):
        return "it has init, sidecar or ephemeral containers"
    containers = spec.get("containers") or []
    if len(containers) != 1 or not str(containers[0].get("image", "")).startswith(_PAUSE):
        return "it is not one pause container"
    if _ours((spec.get("resources") or {}).get("requests") or {}) or _ours(
        (spec.get("resources") or {}).get("limits") or {}
    ):
        return "it asks for tokenpools resources at the pod level"
    requests = _requests(containers[0].get("resources") or {})
    if requests is None:
        return "its requests are not what the operator asks for"
    if meta.get("name") != o.lease_pod_name(owner_name, service_class, requests):
        return "its name does not match its class and requests"
    return Lease(service_class, requests)


def _requests(resources: Mapping[str, Any]) -> dict[str, int] | None:
    """The tokenpools.io/* requests when they equal the limits, each a whole number. Quantities
    are compared as numbers: the API server stores them in canonical form ("40000" as "40k").
    Other resources are not the proof's business: a LimitRange default or a mutating admission
    webhook (GKE Autopilot, Kyverno) may add or change cpu, memory or ephemeral-storage."""
    asked, limits = (_ours(resources.get(key) or {}) for key in ("requests", "limits"))
    if _numbers(asked) != _numbers(limits):
        return None
    out: dict[str, int] = {}
    for name, quantity in asked.items():
        if (amount := q.whole(quantity)) is None:
            return None
        out[name] = amount
    return out


def _ours(quantities: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in quantities.items() if k.startswith(RESOURCE_PREFIX)}


def _number(quantity: Any) -> Fraction | None:
    try:
        return q.parse(quantity)
    except ValueError:
        return None


def _numbers(quantities: Mapping[str, Any]) -> dict[str, Fraction | None]:
    return {name: _number(quantity) for name, quantity in quantities.items()}
