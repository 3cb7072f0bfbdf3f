"""Installing deploy/ as a user does: into a namespace of their own (one `namespace:` in their
kustomization, deploy/namespace's transformers after it) and with the usage ledger in
PostgreSQL (deploy/ledger-postgres). Rendered by `kubectl kustomize`; the admission policies
and RBAC that come out are evaluated as the API server would (tests/kube/admission.py,
tests/test_k8s_rbac.py), and the ledger's password path runs against a real PostgreSQL."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.kube import admission
from tests.postgres import restartable_postgres
from tests.test_k8s_gateways import _admitted
from tests.test_k8s_manifests import (
    CLUSTER_SCOPED,
    DEPLOY,
    TRANSFORMERS,
    _kustomize,
    install_dirs,
    restricted_violations,
)
from tests.test_k8s_rbac import Who, can
from tokenpools.k8s import objects as o
from tokenpools.model.config_schema import ConfigSpec
from tokenpools.model.service_class import ServiceClass
from tokenpools.usage.database import LedgerUnavailable, UsageDatabase

DEFAULT = "tokenpools-system"
NS = "llm-platform"
NODE_LEASES = "kube-node-lease"
# what a whole install lists (the processor's overlay brings deploy/redis and deploy/base)
EVERYTHING = ("extproc/envoy-gateway", "webhook", "ledger-postgres", "monitoring", "autoscaling")


def _install(tmp: Path, parts: tuple[str, ...], namespace: str | None,
             transformers: bool = True) -> list[dict[str, Any]]:  # fmt: skip
    """Render a user's kustomization in `tmp` that lists `parts` of deploy/."""
    here = tmp / "install"
    here.mkdir(exist_ok=True)
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / part, here) for part in parts],
    }
    if namespace is not None:
        kustomization["namespace"] = namespace
    if transformers:
        kustomization["transformers"] = [os.path.relpath(DEPLOY / "namespace", here)]
    (here / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return _kustomize(here)


def _misplaced(docs: list[dict[str, Any]], namespace: str) -> list[str]:
    """Everything in `docs` that is not where an install into `namespace` puts it."""
    out = []
    for doc in docs:
        kind, meta = doc["kind"], doc["metadata"]
        where = meta.get("namespace")
        want = NODE_LEASES if meta["name"] == "tokenpools-node-leases" else namespace
        if kind not in CLUSTER_SCOPED and where != want:
            out.append(f"{kind}/{meta['name']} in {where}")
        if kind in CLUSTER_SCOPED and where:
            out.append(f"{kind}/{meta['name']} (cluster-scoped) in {where}")
        if kind == "Namespace" and meta["name"] != namespace:
            out.append(f"Namespace {meta['name']}")
        for subject in doc.get("subjects", []):
            if subject["kind"] == "ServiceAccount" and subject.get("namespace") != namespace:
                out.append(f"{kind}/{meta['name']}: subject {subject}")
        for pod in _pod_specs(doc):
            for container in pod["containers"]:
                args = container.get("args", [])
                if "--namespace" not in args:
                    continue
                given = args[args.index("--namespace") + 1]
                env = {e["name"]: e for e in container.get("env", [])}
                source = env.get("POD_NAMESPACE", {}).get("valueFrom", {}).get("fieldRef")
                if given != "$(POD_NAMESPACE)" or source != {"fieldPath": "metadata.namespace"}:
                    out.append(f"{kind}/{meta['name']}: --namespace {given}")
    text = yaml.safe_dump_all(docs)
    if namespace != DEFAULT and DEFAULT in text:
        out.append(f"{DEFAULT} in: {sorted(set(re.findall(r'.*' + DEFAULT + '.*', text)))}")
    return out


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]["spec"]]
    return []


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize(
    "parts",
    [EVERYTHING, ("extproc/kgateway",), ("extproc/agentgateway", "webhook"), ("base",)],
    ids=["everything", "kgateway", "agentgateway", "base"],
)
def test_an_install_into_another_namespace_leaves_nothing_in_tokenpools_system(
    tmp_path: Path, parts: tuple[str, ...]
) -> None:
    docs = _install(tmp_path, parts, NS)
    assert _misplaced(docs, NS) == []
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == [NS]
    # every pod that takes --namespace gets it from the downward API; every one is here
    takers = {d["metadata"]["name"] for d in docs for pod in _pod_specs(d)
              for c in pod["containers"] if "--namespace" in c.get("args", [])}  # fmt: skip
    assert {"tokenpools-operator", "tokenpools-gateway"} <= takers
    if parts != ("base",):
        assert "tokenpools-extproc" in takers
        # the gateway policies sit beside the processor's Service, the route and the pool
        policies = [d for d in docs if d["kind"] in
                    ("EnvoyExtensionPolicy", "TrafficPolicy", "AgentgatewayPolicy")]  # fmt: skip
        assert policies and {p["metadata"]["namespace"] for p in policies} == {NS}
        assert _one(docs, "Service", "tokenpools-extproc")["metadata"]["namespace"] == NS


def test_the_check_finds_what_kustomizes_namespace_alone_leaves_behind(tmp_path: Path) -> None:
    """Without deploy/namespace the install is wrong, and the check says where."""
    wrong = _misplaced(_install(tmp_path, EVERYTHING, NS, transformers=False), NS)
    assert any("tokenpools-node-leases in llm-platform" in w for w in wrong)  # moved, wrongly
    assert any("system:serviceaccount:tokenpools-system:tokenpools-operator" in w for w in wrong)
    assert any("tokenpools-operator.tokenpools-system.svc" in w for w in wrong)
    assert any("ValidatingAdmissionPolicy/tokenpools-lease-pods (cluster-scoped)" in w
               for w in wrong)  # fmt: skip


def test_without_a_namespace_the_transformers_change_nothing(tmp_path: Path) -> None:
    plain = _install(tmp_path, EVERYTHING, None, transformers=False)
    assert _install(tmp_path, EVERYTHING, None) == plain
    assert _misplaced(plain, DEFAULT) == []
    assert _install(tmp_path, EVERYTHING, DEFAULT) == plain  # named as it is: the same


def test_the_namespace_directory_holds_transformers_only() -> None:
    [directory] = TRANSFORMERS
    assert directory not in install_dirs()
    docs = _kustomize(directory)
    assert {(d["apiVersion"], d["kind"]) for d in docs} == {
        ("builtin", "ReplacementTransformer"),
        ("builtin", "PatchTransformer"),
    }


def test_the_admission_policies_know_the_operator_in_its_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _install(tmp_path, ("base",), NS)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs
                if d["kind"] == "ValidatingAdmissionPolicy"}  # fmt: skip
    monkeypatch.setattr(admission, "policy", lambda name: policies[name])
    operator = f"system:serviceaccount:{NS}:tokenpools-operator"
    elsewhere = f"system:serviceaccount:{DEFAULT}:tokenpools-operator"  # anyone's, there
    # its installation id is the namespace, in the operator's setting and in the policy alike
    [container] = _one(docs, "Deployment", "tokenpools-operator")["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TOKENPOOLS_INSTALLATION"] == NS
    mine, theirs = o.node("qwen", NS), o.node("qwen", DEFAULT)
    scope = "tokenpools-operator-scope"
    assert admission.refusals(scope, "CREATE", "nodes", mine, user=operator) == []
    assert admission.refusals(scope, "CREATE", "nodes", theirs, user=operator) != []
    ent = {"metadata": {"name": "gold", "namespace": "team-a", "uid": "u"}, "spec": {"pool": "q"}}
    lease = o.lease_pod(ent, ServiceClass.GUARANTEED, {"tokenpools.io/concurrency": 2}, NS)
    leases = "tokenpools-lease-pods"
    assert admission.refusals(leases, "CREATE", "pods", lease, user=operator) == []
    # a service account of that name in the old namespace is nobody here
    assert admission.refusals(leases, "CREATE", "pods", lease, user=elsewhere) != []


def test_rbac_in_another_namespace_grants_there_and_in_kube_node_lease(tmp_path: Path) -> None:
    docs = _install(tmp_path, ("extproc/processor",), NS)
    rbac = [d for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding",
                                             "ClusterRoleBinding")]  # fmt: skip
    operator = Who("ServiceAccount", "tokenpools-operator", NS)
    assert can(operator, "patch", "coordination.k8s.io", "leases", NODE_LEASES, rbac)
    assert can(operator, "create", "coordination.k8s.io", "leases", NS, rbac)  # the leader's
    assert not can(operator, "patch", "coordination.k8s.io", "leases", DEFAULT, rbac)
    for name in ("tokenpools-gateway", "tokenpools-extproc"):
        who = Who("ServiceAccount", name, NS)
        assert can(who, "watch", "", "secrets", NS, rbac)
        assert not can(who, "watch", "", "secrets", DEFAULT, rbac)
        assert can(who, "create", "", "events", NS, rbac)
        assert can(who, "list", "tokenpools.io", "tokenentitlements", None, rbac)
        # the same account name in the old namespace holds nothing
        assert not can(Who("ServiceAccount", name, DEFAULT), "list", "tokenpools.io",
                       "tokenpools", None, rbac)  # fmt: skip


def test_the_webhook_certificate_names_the_service_in_its_namespace(tmp_path: Path) -> None:
    docs = _install(tmp_path, ("base", "webhook"), NS)
    webhook = _one(docs, "ValidatingWebhookConfiguration", "tokenpools")
    certificate = _one(docs, "Certificate", "tokenpools-webhook")
    [hook] = webhook["webhooks"]
    service = hook["clientConfig"]["service"]
    assert (service["name"], service["namespace"]) == ("tokenpools-operator", NS)
    _one(docs, "Service", service["name"])  # it exists, in the install
    assert certificate["spec"]["dnsNames"] == [
        f"{service['name']}.{NS}.svc",
        f"{service['name']}.{NS}.svc.cluster.local",
    ]
    meta = certificate["metadata"]
    annotation = webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == f"{meta['namespace']}/{meta['name']}"


# -- the usage ledger in PostgreSQL ---------------------------------------------------------

LEDGER = DEPLOY / "ledger-postgres"


def _documented_base() -> dict[str, Any]:
    """The config file the ledger recipe tells the user to write (kustomization.yaml)."""
    text = (LEDGER / "kustomization.yaml").read_text()
    match = re.search(r"#   cat > base.yaml <<EOF\n(.*?)#   EOF\n", text, re.S)
    assert match, "the recipe's base.yaml is gone from deploy/ledger-postgres/kustomization.yaml"
    body = "\n".join(line.removeprefix("#   ") for line in match.group(1).splitlines())
    base: dict[str, Any] = yaml.safe_load(body.replace("$PASS", "p4ss"))
    return base


def test_the_ledger_recipe_names_the_database_it_runs() -> None:
    base = _documented_base()
    # beside the cluster: no pools or entitlements, and valid once the cluster adds them
    assert not {"pools", "entitlements"} & set(base)
    ConfigSpec.model_validate({**base, "pools": []})
    assert base["state"]["backend"] == "redis"  # the gateway's store: one pool, one count
    url = urlsplit(base["usage"]["database"])
    assert url.password is None  # the password comes as PGPASSWORD, never in the file
    docs = _kustomize(LEDGER)
    service = _one(docs, "Service", "tokenpools-postgres")
    [port] = service["spec"]["ports"]
    assert (url.hostname, url.port) == (service["metadata"]["name"], port["port"])
    server = _one(docs, "StatefulSet", "tokenpools-postgres")
    assert _selects_pod(service, server)
    pod = server["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]] == 5432
    env = {e["name"]: e for e in container["env"]}
    assert (url.username, url.path) == (env["POSTGRES_USER"]["value"],
                                        "/" + env["POSTGRES_DB"]["value"])  # fmt: skip
    assert env["POSTGRES_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": "tokenpools-postgres", "key": "password"}
    }
    assert restricted_violations(pod) == []
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # its data on a volume of its own, below its root (initdb wants an empty directory)
    data = next(m for m in container["volumeMounts"] if m["name"] == "data")
    assert env["PGDATA"]["value"].startswith(data["mountPath"] + "/")
    assert [t["metadata"]["name"] for t in server["spec"]["volumeClaimTemplates"]] == ["data"]


def _selects_pod(service: dict[str, Any], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_the_gateway_and_the_processor_take_the_password_and_reach_the_database() -> None:
    docs = _kustomize(DEPLOY / "extproc" / "processor") + _kustomize(LEDGER)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    server = _one(docs, "StatefulSet", "tokenpools-postgres")["spec"]["template"]["metadata"]
    [port] = _one(docs, "Service", "tokenpools-postgres")["spec"]["ports"]
    for name in ("tokenpools-gateway", "tokenpools-extproc"):
        deployment = _one(docs, "Deployment", name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert _admitted(policies, server["labels"], labels, port["port"]), name
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        # optional: without the ledger overlay (no Secret) the pods start all the same
        assert env["PGPASSWORD"]["valueFrom"] == {
            "secretKeyRef": {"name": "tokenpools-postgres", "key": "password", "optional": True}
        }
    for name in ("tokenpools-operator", "tokenpools-redis"):  # and no one else gets in
        labels = _one(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert not _admitted(policies, server["labels"], labels, port["port"]), name


def test_a_url_without_a_password_connects_with_pgpassword(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The recipe's password path, through the ledger's own driver: libpq takes PGPASSWORD
    for a URL that names none, and a server that wants a password refuses it without."""
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "none"))  # no ~/.pgpass may answer
    for name in ("PGPASSWORD", "PGHOST", "PGUSER", "PGSERVICE"):
        monkeypatch.delenv(name, raising=False)
    with restartable_postgres() as server:
        hba = Path(server.data) / "pg_hba.conf"
        # TCP asks for a password; the local socket (used here to set it) stays trusted
        lines = [re.sub(r"\btrust$", "scram-sha-256", line) if line.startswith("host") else line
                 for line in hba.read_text().splitlines()]  # fmt: skip
        assert any(line.endswith("scram-sha-256") for line in lines)
        hba.write_text("\n".join(lines) + "\n")
        with server.connect_local() as conn:
            conn.execute("ALTER ROLE tokenpools PASSWORD 'ledger-secret'")
            conn.execute("SELECT pg_reload_conf()")
        url = server.url
        assert urlsplit(url).password is None

        def read() -> list[Any]:
            database = UsageDatabase(url, timeout_s=2)
            try:
                return database.read(0, 3600)
            finally:
                database.close()

        with pytest.raises(LedgerUnavailable):  # no password: refused
            read()
        monkeypatch.setenv("PGPASSWORD", "wrong")
        with pytest.raises(LedgerUnavailable):
            read()
        monkeypatch.setenv("PGPASSWORD", "ledger-secret")
        assert read() == []  # connected, the schema made, nothing written yet
