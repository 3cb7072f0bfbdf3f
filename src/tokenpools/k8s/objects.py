"""The Kubernetes objects the operator owns, as manifests (pure builders, no I/O).

A lease pod does no work: one `pause` container whose requests (= limits) are the
entitlement's integer baseline (control/placement.py) and a token amount of cpu and memory,
the annotation naming the installation that made it, the service class's PriorityClass,
the toleration and node selector of its pool's virtual node, tolerations of an unreachable or
not-ready node without a time limit (a heartbeat gap must never evict a lease), an owner
reference to the entitlement (so the garbage collector removes it with the entitlement), the
Pod Security `restricted` settings, no service account token, no service links, and a zero
grace period. Its name carries a digest of what it requests, so a resize is a new pod that
binds before the old one goes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from tokenpools.control.placement import PRIORITY_CLASSES
from tokenpools.k8s.names import label_value, node_name, pod_name
from tokenpools.k8s.schema import API_VERSION
from tokenpools.model.service_class import ServiceClass

POOL_LABEL = "tokenpools.io/pool"
LEASE_LABEL = "tokenpools.io/lease"  # "true" on every lease pod; how the operator lists them
ENTITLEMENT_LABEL = "tokenpools.io/entitlement"
# Which installation of tokenpools made a virtual node (its value: the installation id, by
# default the platform's namespace; `tokenpools operator --installation`). A Node without this
# installation's id is never adopted, patched, its pods failed, or deleted; its lease pods
# select it, so nothing binds to a node of the same name someone else made.
INSTALLATION_LABEL = "tokenpools.io/installation"
DEFAULT_INSTALLATION = "tokenpools-system"
# The label the platform sets on a Secret that holds a backend key: the gateway lists and
# watches Secrets by it, so a TokenPool's apiKeySecretRef can name no other Secret.
BACKEND_KEY_LABEL = "tokenpools.io/backend-key"
# Who made a lease pod: this installation's id. Like the lease label, a tokenpools-* PriorityClass
# and a TokenEntitlement owner, only the operator may put it on a pod (the tokenpools-lease-pods
# admission policy), so together they prove a pod is one the operator created.
MADE_BY_ANNOTATION = "tokenpools.io/made-by"
# NoExecute: nothing but a lease pod is scheduled onto a virtual node, and a pod that gets there
# without the scheduler (spec.nodeName) is evicted by the taint manager. Lease pods tolerate it.
TAINT = {"key": "virtual-kubelet.io/provider", "value": "tokenpools", "effect": "NoExecute"}
FINALIZER = "tokenpools.io/cleanup"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
NODE_LEASE_NAMESPACE = "kube-node-lease"
NODE_LEASE_S = 40
# What a lease pod requests of cpu and memory (requests = limits): small, but given, so a
# namespace ResourceQuota that requires cpu/memory requests or limits accepts lease pods, and a
# LimitRange's defaults are not injected. The virtual node advertises exactly what its pods can
# request: NODE_PODS lease pods' worth, not a fictitious 1,000 CPUs.
LEASE_CPU_MILLI, LEASE_MEMORY_MI, NODE_PODS = 1, 4, 500
LEASE_CPU, LEASE_MEMORY = f"{LEASE_CPU_MILLI}m", f"{LEASE_MEMORY_MI}Mi"
NODE_CPU, NODE_MEMORY = f"{LEASE_CPU_MILLI * NODE_PODS}m", f"{LEASE_MEMORY_MI * NODE_PODS}Mi"
# room for the ephemeral-storage a LimitRange default or a webhook may add to each lease pod
# (a pause container writes nothing): without it the scheduler would place none of them
NODE_EPHEMERAL_STORAGE = f"{10 * NODE_PODS}Gi"


def iso(now: float) -> str:
    return datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro(now: float) -> str:
    return datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def installation_id(given: str | None, namespace: str) -> str:
    """This installation's id as a label value: `given`, else the platform's namespace."""
    return label_value(given or namespace)


def node(pool: str, installation: str = DEFAULT_INSTALLATION) -> dict[str, Any]:
    name = node_name(pool)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                POOL_LABEL: label_value(pool),
                INSTALLATION_LABEL: installation,
                "type": "virtual-kubelet",
                "kubernetes.io/role": "agent",
                "kubernetes.io/hostname": label_value(name),
                # what the kubelet sets on every node; DaemonSets and pods select on it
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
        "spec": {"taints": [TAINT]},
    }


def node_status(allocatable: Mapping[str, int], now: float, message: str) -> dict[str, Any]:
    resources = {
        **{k: str(v) for k, v in allocatable.items()},
        "cpu": NODE_CPU,
        "memory": NODE_MEMORY,
        "ephemeral-storage": NODE_EPHEMERAL_STORAGE,
        "pods": str(NODE_PODS),
    }
    beat = iso(now)

    def cond(kind: str, status: str, reason: str, text: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": text,
            "lastHeartbeatTime": beat,
            "lastTransitionTime": beat,
        }

    return {
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                cond("Ready", "True", "TokenPoolReady", message),
                cond("MemoryPressure", "False", "TokenPoolReady", "virtual node"),
                cond("DiskPressure", "False", "TokenPoolReady", "virtual node"),
                cond("PIDPressure", "False", "TokenPoolReady", "virtual node"),
            ],
            "nodeInfo": {
                "kubeletVersion": "tokenpools",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
    }


def node_lease(name: str, now: float) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": NODE_LEASE_NAMESPACE},
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": NODE_LEASE_S,
            "renewTime": micro(now),
        },
    }


def lease_pod_name(
    entitlement: str, service_class: ServiceClass, requests: Mapping[str, int]
) -> str:
    """Requests and priority are immutable in a pod: a different lease is a different name."""
    what = json.dumps([PRIORITY_CLASSES[service_class].name, sorted(requests.items())])
    return f"{pod_name(entitlement)[:243]}-{hashlib.sha256(what.encode()).hexdigest()[:8]}"


_UNTIL_BACK = [  # no tolerationSeconds: tolerate for as long as it lasts
    {"key": f"node.kubernetes.io/{why}", "operator": "Exists", "effect": "NoExecute"}
    for why in ("unreachable", "not-ready")
]
_RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 65535,  # the pause image's own user
    "seccompProfile": {"type": "RuntimeDefault"},
}
_RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def lease_pod(
    ent: Mapping[str, Any],
    service_class: ServiceClass,
    requests: Mapping[str, int],
    installation: str = DEFAULT_INSTALLATION,
) -> dict[str, Any]:
    meta = ent["metadata"]
    ns, name, pool = meta["namespace"], meta["name"], ent["spec"]["pool"]
    quantities = {
        **{k: str(v) for k, v in requests.items()},
        "cpu": LEASE_CPU,
        "memory": LEASE_MEMORY,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": lease_pod_name(name, service_class, requests),
            "namespace": ns,
            "labels": {
                LEASE_LABEL: "true",
                ENTITLEMENT_LABEL: label_value(name),
                POOL_LABEL: label_value(pool),
            },
            "annotations": {MADE_BY_ANNOTATION: installation},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "TokenEntitlement",
                    "name": name,
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "priorityClassName": PRIORITY_CLASSES[service_class].name,
            # the pool's node of this installation only: never a node of that name or pool
            # label that another installation, or anyone, made
            "nodeSelector": {POOL_LABEL: label_value(pool), INSTALLATION_LABEL: installation},
            "tolerations": [
                # every effect, for as long as it lasts: a node made before the taint became
                # NoExecute still has it as NoSchedule
                {"key": TAINT["key"], "operator": "Exists"},
                *_UNTIL_BACK,
            ],
            "securityContext": _RESTRICTED_POD,
            "containers": [
                {
                    "name": "lease",
                    "image": PAUSE_IMAGE,
                    "resources": {"requests": quantities, "limits": dict(quantities)},
                    "securityContext": _RESTRICTED_CONTAINER,
                }
            ],
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 0,
        },
    }


def owner_uid(pod: Mapping[str, Any]) -> str | None:
    """The uid of the TokenEntitlement that controls the pod, if one does."""
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == "TokenEntitlement" and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def failed_status(reason: str, message: str) -> dict[str, Any]:
    return {"status": {"phase": "Failed", "reason": reason, "message": message}}


def running_status(now: float) -> dict[str, Any]:
    t = iso(now)
    ready = [
        {"type": c, "status": "True", "lastTransitionTime": t}
        for c in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
    ]
    return {"status": {"phase": "Running", "conditions": ready, "startTime": t}}


def priority_classes() -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": pc.name},
            "value": pc.value,
            "globalDefault": False,
            "preemptionPolicy": "PreemptLowerPriority" if pc.preempts else "Never",
            "description": pc.description,
        }
        for pc in PRIORITY_CLASSES.values()
    ]


def event(
    involved: Mapping[str, Any], reason: str, message: str, now: float, kind: str = "Normal"
) -> dict[str, Any]:
    meta = involved["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        },
        "reason": reason,
        "message": message,
        "type": kind,
        "source": {"component": "tokenpools-operator"},
        "firstTimestamp": iso(now),
        "lastTimestamp": iso(now),
        "count": 1,
    }


def condition(
    kind: str, ok: bool, reason: str, message: str, now: float, gen: int
) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": iso(now),
        "observedGeneration": gen,
    }
