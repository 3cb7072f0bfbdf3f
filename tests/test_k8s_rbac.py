"""RBAC as shipped, read from deploy/ and evaluated by the rules Kubernetes' RBAC authorizer
applies (a RoleBinding grants in its namespace only, and grants nothing cluster-scoped; a
subresource is its own resource; verbs, groups and resources match exactly or by "*"): a
tenant cannot create a pool, write a status, or read another tenant's anything, and no
component can be made to read a file or a Secret by what a tenant writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tokenpools.k8s.crds import crds
from tokenpools.k8s.custom_resources import check_spec

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CLUSTER_RESOURCES = {"tokenpools", "tokenbudgets", "nodes", "namespaces", "priorityclasses"}


@dataclass(frozen=True)
class Who:
    kind: str  # ServiceAccount, Group, User
    name: str
    namespace: str | None = None


TENANT = Who("Group", "team-a")
OPERATOR = Who("ServiceAccount", "tokenpools-operator", "tokenpools-system")
GATEWAY = Who("ServiceAccount", "tokenpools-gateway", "tokenpools-system")
EXTPROC = Who("ServiceAccount", "tokenpools-extproc", "tokenpools-system")
RBAC_FILES = (
    DEPLOY / "base" / "rbac.yaml",
    DEPLOY / "extproc" / "processor" / "rbac.yaml",
    DEPLOY / "tenant" / "rolebinding.yaml",
)


def _objects() -> list[dict[str, Any]]:
    docs = []
    for path in RBAC_FILES:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def can(
    who: Who,
    verb: str,
    group: str,
    resource: str,
    namespace: str | None,
    objects: list[dict[str, Any]] | None = None,
) -> bool:
    """namespace None: a cluster-wide request (cluster-scoped resource, or all namespaces).
    `objects`: the RBAC to evaluate (default: the shipped files, as written)."""
    docs = _objects() if objects is None else objects
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}  # fmt: skip
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(_is(who, s) for s in binding["subjects"]):
            continue
        where = binding["metadata"].get("namespace")
        cluster_wide = namespace is None or resource.split("/")[0] in CLUSTER_RESOURCES
        if binding["kind"] == "RoleBinding" and (cluster_wide or namespace != where):
            continue
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], where if ref["kind"] == "Role" else None, ref["name"]))
        for rule in (role or {}).get("rules", []):
            if (_any(rule["verbs"], verb) and _any(rule["apiGroups"], group)
                    and _any(rule["resources"], resource)):  # fmt: skip
                return True
    return False


def _is(who: Who, subject: dict[str, Any]) -> bool:
    return (subject["kind"], subject["name"], subject.get("namespace")) == (
        who.kind, who.name, who.namespace if who.kind == "ServiceAccount" else None
    )  # fmt: skip


def _any(allowed: list[str], value: str) -> bool:
    return "*" in allowed or value in allowed


TP = "tokenpools.io"


def test_a_tenant_manages_its_entitlements_in_its_own_namespace_only() -> None:
    for verb in ("create", "get", "update", "patch", "delete", "list"):
        assert can(TENANT, verb, TP, "tokenentitlements", "team-a")
        assert not can(TENANT, verb, TP, "tokenentitlements", "team-b")
    assert not can(TENANT, "list", TP, "tokenentitlements", None)


def test_a_tenant_cannot_touch_pools_status_keys_or_leases() -> None:
    for verb in ("create", "update", "patch", "delete"):
        assert not can(TENANT, verb, TP, "tokenpools", None)
        assert not can(TENANT, verb, TP, "tokenbudgets", None)  # no tenant raises its budget
    for sub in ("tokenentitlements/status", "tokenpools/status", "tokenbudgets/status"):
        assert not can(TENANT, "patch", TP, sub, "team-a")
    for ns in ("team-a", "team-b", "tokenpools-system", None):
        assert not can(TENANT, "get", "", "secrets", ns)
        assert not can(TENANT, "delete", "", "pods", ns if ns != "team-a" else "team-b")
        assert not can(TENANT, "create", "", "pods/binding", ns)


def test_components_hold_least_privilege() -> None:
    # the gateway lists and watches Secrets in the platform's namespace only (by a label
    # selector: tests/test_k8s_ownership.py), gets none by name, and writes nothing but Events
    for verb in ("list", "watch"):
        assert can(GATEWAY, verb, "", "secrets", "tokenpools-system")
        assert not can(GATEWAY, verb, "", "secrets", "team-a")
        assert not can(GATEWAY, verb, "", "secrets", None)
    assert not can(GATEWAY, "get", "", "secrets", "tokenpools-system")
    assert can(GATEWAY, "create", "", "events", "tokenpools-system")
    assert not can(GATEWAY, "create", "", "events", "team-a")
    for verb in ("create", "update", "patch", "delete"):
        assert not can(GATEWAY, verb, TP, "tokenentitlements", "team-a")
        assert not can(GATEWAY, verb, TP, "tokenbudgets", None)
        assert not can(GATEWAY, verb, TP, "tokenpools/status", None)
        assert not can(GATEWAY, verb, "", "secrets", "tokenpools-system")
    assert can(GATEWAY, "watch", TP, "tokenbudgets", None)
    assert can(OPERATOR, "patch", TP, "tokenbudgets/status", None)
    assert not can(OPERATOR, "patch", TP, "tokenbudgets", None)
    # the operator reads no Secrets, scales only the platform's workloads, and makes no
    # workload (its pods are lease pods: the admission policy; tests/test_k8s_cel.py)
    for ns in ("team-a", "tokenpools-system", None):
        assert not can(OPERATOR, "get", "", "secrets", ns)
    assert can(OPERATOR, "patch", "apps", "deployments/scale", "tokenpools-system")
    assert not can(OPERATOR, "patch", "apps", "deployments/scale", "team-a")
    assert not can(OPERATOR, "create", "apps", "deployments", "tokenpools-system")
    assert can(OPERATOR, "patch", "coordination.k8s.io", "leases", "kube-node-lease")
    assert not can(OPERATOR, "patch", "coordination.k8s.io", "leases", "team-a")
    assert can(OPERATOR, "create", "", "pods", "team-a")  # lease pods live with tenants
    # Nodes: created and deleted (only its installation's: the admission policy,
    # tests/test_k8s_ownership.py), their status patched, but never updated or patched: it
    # cannot relabel a Node someone else made into one of its own
    for verb in ("create", "delete"):
        assert can(OPERATOR, verb, "", "nodes", None)
    assert can(OPERATOR, "patch", "", "nodes/status", None)
    for verb in ("update", "patch", "deletecollection"):
        assert not can(OPERATOR, verb, "", "nodes", None)
    for verb in ("update", "patch", "deletecollection"):  # pods: create, delete, status only
        assert not can(OPERATOR, verb, "", "pods", "team-a")


def _informed() -> list[tuple[str, str, str | None]]:
    """(group, resource, namespace) of every list-then-watch `--kubernetes` keeps, serve and
    extproc alike (k8s/source.py), for the platform's namespace."""
    from tokenpools.k8s.source import ClusterSource

    source = ClusterSource(None, "tokenpools-system", {})  # type: ignore[arg-type]
    out = []
    for informer in source._informers:
        group = informer.kind.api_version.rpartition("/")[0]
        out.append((group, informer.kind.plural, informer.namespace))
    return out


def test_the_processor_reads_what_its_informers_watch_and_writes_only_events() -> None:
    informed = _informed()
    assert {r for _, r, _ in informed} == {"tokenpools", "tokenentitlements", "tokenbudgets",
                                            "secrets"}  # fmt: skip
    for group, resource, namespace in informed:
        for verb in ("list", "watch"):
            assert can(EXTPROC, verb, group, resource, namespace), (verb, resource)
            assert can(GATEWAY, verb, group, resource, namespace), (verb, resource)
        assert not can(EXTPROC, "get", group, resource, namespace)  # nothing asked by name
    # Secrets of its own namespace only (backend keys, by a label selector: RBAC cannot)
    for ns in ("team-a", "kube-system", None):
        assert not can(EXTPROC, "list", "", "secrets", ns)
    # its one write: an Event on a pool whose backend key it refuses, in its namespace
    assert can(EXTPROC, "create", "", "events", "tokenpools-system")
    assert not can(EXTPROC, "create", "", "events", "team-a")
    for verb in ("create", "update", "patch", "delete", "deletecollection"):
        for resource in ("tokenpools", "tokenentitlements", "tokenbudgets", "tokenpools/status",
                         "tokenentitlements/status", "tokenbudgets/status"):  # fmt: skip
            assert not can(EXTPROC, verb, TP, resource, "team-a")
            assert not can(EXTPROC, verb, TP, resource, None)
        assert not can(EXTPROC, verb, "", "secrets", "tokenpools-system")
        assert not can(EXTPROC, verb, "", "pods", "team-a")


def _beyond_the_gateway(who: Who) -> tuple[int, list[tuple[str, str, str | None]]]:
    """How many rights of a grid `who` holds, and those the gateway does not hold."""
    grid = [(TP, r) for r in ("tokenpools", "tokenentitlements", "tokenbudgets",
                              "tokenpools/status", "tokenentitlements/status")]  # fmt: skip
    grid += [("", r) for r in ("secrets", "events", "pods", "nodes", "namespaces", "configmaps")]
    grid += [("coordination.k8s.io", "leases"), ("apps", "deployments/scale"),
             ("llm-d.ai", "inferenceobjectives")]  # fmt: skip
    held, beyond, objects = 0, [], _objects()
    for group, resource in grid:
        for verb in ("get", "list", "watch", "create", "update", "patch", "delete"):
            for ns in ("tokenpools-system", "team-a", "kube-node-lease", None):
                if can(who, verb, group, resource, ns, objects):
                    held += 1
                    if not can(GATEWAY, verb, group, resource, ns, objects):
                        beyond.append((verb, resource, ns))
    return held, beyond


def test_the_processor_holds_nothing_the_gateway_does_not() -> None:
    held, beyond = _beyond_the_gateway(EXTPROC)
    assert held >= 2 * 4 and beyond == []  # list and watch of its four kinds, at least
    assert _beyond_the_gateway(OPERATOR)[1]  # the comparison does find more where there is


def _property_names(node: Any) -> set[str]:
    if isinstance(node, dict):
        names = set(node.get("properties", {}))
        return names | {n for v in node.values() for n in _property_names(v)}
    if isinstance(node, list):
        return {n for v in node for n in _property_names(v)}
    return set()


def test_nothing_a_custom_resource_says_is_read_as_a_file() -> None:
    names = set().union(*(_property_names(c["spec"]["versions"][0]["schema"]) for c in crds()))
    assert not {n for n in names if "file" in n.lower() or "path" in n.lower()}
    assert {"apiKeySecretRef", "apiKeyHashes", "namespaceSelector"} <= names
    pool = {"model": "Qwen3-8B", "perReplica": {"tokensPerSecond": 1, "concurrency": 1,
                                                "kvTokens": 1}}  # fmt: skip
    assert check_spec("TokenPool", pool, "", "p") is None
    for sneaky in ({"tokenizer": "/var/run/secrets/kubernetes.io/serviceaccount/token"},
                   {"backends": [{"url": "http://evil", "apiKeyFile": "/etc/token"}]},
                   {"backends": [{"url": "http://evil", "apiKeyEnv": "AWS_SECRET"}]}):  # fmt: skip
        assert check_spec("TokenPool", {**pool, **sneaky}, "", "p") is not None, sneaky


def test_a_name_a_tenant_writes_never_walks_an_api_path_elsewhere() -> None:
    import pytest

    from tokenpools.k8s.api import POOLS, Kube
    from tokenpools.k8s.webhook_cache import CachedLookup

    assert POOLS.path(None, "qwen") == "/apis/tokenpools.io/v1alpha1/tokenpools/qwen"
    sneaky = ("../../../api/v1/namespaces/team-b/secrets/keys", "..", "a/b", "a%2Fb", "a?x=1")
    for name in sneaky:
        with pytest.raises(ValueError):
            POOLS.path(None, name)

    class NoCalls(Kube):
        def request(self, *_: Any, **__: Any) -> Any:  # no request may leave
            raise AssertionError("a request was made")

    lookup = CachedLookup(NoCalls(None))  # type: ignore[arg-type]
    assert all(lookup.pool(name) is None for name in sneaky)


def test_the_operator_writes_inference_objectives_beside_the_inference_pools_only() -> None:
    for group in ("llm-d.ai", "inference.networking.x-k8s.io"):
        for verb in ("list", "create", "patch", "delete"):
            assert can(OPERATOR, verb, group, "inferenceobjectives", "tokenpools-system")
            assert not can(OPERATOR, verb, group, "inferenceobjectives", "team-a")
            assert not can(OPERATOR, verb, group, "inferenceobjectives", None)
        for verb in ("get", "watch", "update"):  # never asked for: one labelled list a pass
            assert not can(OPERATOR, verb, group, "inferenceobjectives", "tokenpools-system")
        assert not can(OPERATOR, "list", group, "inferencepools", "tokenpools-system")
        for who in (GATEWAY, TENANT):
            assert not can(who, "list", group, "inferenceobjectives", "tokenpools-system")
