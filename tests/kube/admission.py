"""The ValidatingAdmissionPolicies of deploy/base run as the API server runs them, with a CEL
library: a policy applies to a request its resource rules and matchConditions match; its
variables are evaluated in order, each seeing the ones before; the messages of the validations
that fail are the refusals. No admission chain in the API stand-in (tests/kube/apiserver.py)
runs them, so the tests ask this."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from cel import cel  # the compiled module: xds-protos' own top-level `cel` may empty __init__

POLICIES = Path(__file__).resolve().parents[2] / "deploy" / "base" / "admission-policy.yaml"
OPERATOR = "system:serviceaccount:tokenpools-system:tokenpools-operator"


def policy(name: str) -> dict[str, Any]:
    """The policy's spec; its binding must deny."""
    docs = [d for d in yaml.safe_load_all(POLICIES.read_text()) if d]
    [found] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
               and d["metadata"]["name"] == name]  # fmt: skip
    [binding] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                 and d["spec"]["policyName"] == name]  # fmt: skip
    assert binding["spec"]["validationActions"] == ["Deny"]
    spec: dict[str, Any] = found["spec"]
    return spec


def refusals(
    name: str,
    operation: str,
    resource: str,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None = None,
    user: str = OPERATOR,
    sub: str = "",
) -> list[str]:
    """The messages of policy `name`'s validations that fail for this request ([] when the
    policy does not apply to it)."""
    spec = policy(name)
    rules = spec["matchConstraints"]["resourceRules"]
    wanted = f"{resource}/{sub}" if sub else resource
    if not any(operation in r["operations"] and wanted in r["resources"] for r in rules):
        return []
    ctx: dict[str, Any] = {
        "object": new,
        "oldObject": old,
        "request": {"operation": operation, "userInfo": {"username": user},
                    "resource": {"group": "", "version": "v1", "resource": resource},
                    "subResource": sub},
    }  # fmt: skip
    if not all(cel.evaluate(m["expression"], ctx) for m in spec.get("matchConditions", [])):
        return []
    ctx["variables"] = {}
    for var in spec.get("variables", []):
        ctx["variables"][var["name"]] = cel.evaluate(var["expression"], ctx)
    return [v["message"] for v in spec["validations"] if not cel.evaluate(v["expression"], ctx)]
