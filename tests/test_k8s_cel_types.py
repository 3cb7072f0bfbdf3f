"""The CEL of deploy/base compiled as the API server compiles it, with the types it declares:
every CRD rule against the declarations the API server derives from the CRD's structural schema
(tests/cel_types.py restates SchemaDeclType), and every expression of the
ValidatingAdmissionPolicies as the API server compiles it to admit the policy (`object` dyn) and
as it type-checks it against each kind the policy matches. The checker is a real one:
`cel-expr-python`, Google's CEL C++ with its type checker (test_k8s_cel.py evaluates the rules on
plain dicts, where a field the API server leaves out of CEL is still there). A rule that reads a
field the API server cannot type does not compile here, as it does not there; the TokenPool rule
`type(self.model) != string || ...` on an untyped `model` was such a rule (the CRD would have been
refused at install). Each CRD rule's cost is estimated as the API server estimates it before it
admits the rule (cel-go's estimator over the schema's maxItems/maxLength/maxProperties) and held
under its limits.

The Pod and Node schemas below are restated, not fetched: the parts of Kubernetes' OpenAPI
definitions (core/v1) the policies read, and some around them, typed as Kubernetes declares them,
with one exception: resource.Quantity. Its v3 definition is `oneOf: [string, number]` with no
type, which SchemaDeclType leaves out, so the API server's own type check cannot see
`resources.requests` at all (and reports nothing for the variables that read it, since it
reports validations only, where variables are dyn). Here a quantity is int-or-string (dyn), so
that what is read of those maps, their keys, is still checked.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import cel_types as ct

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "base"
_S = {"type": "string"}
_B = {"type": "boolean"}
_I = {"type": "integer", "format": "int64"}
_TIME = {"type": "string", "format": "date-time"}
_QUANTITY = {"x-kubernetes-int-or-string": True}  # see the docstring
_STRINGS = {"type": "array", "items": _S}
_LABELS = {"type": "object", "additionalProperties": _S}


def _object(required: tuple[str, ...] = (), **props: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    return {**out, "required": list(required)} if required else out


def _map_list(keys: list[str], item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item, "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": keys}  # fmt: skip


OBJECT_META = _object(
    name=_S, generateName=_S, namespace=_S, uid=_S, resourceVersion=_S, generation=_I,
    creationTimestamp=_TIME, deletionTimestamp=_TIME, deletionGracePeriodSeconds=_I,
    labels=_LABELS, annotations=_LABELS, finalizers=_STRINGS,
    ownerReferences=_map_list(["uid"], _object(
        ("apiVersion", "kind", "name", "uid"),
        apiVersion=_S, kind=_S, name=_S, uid=_S, controller=_B, blockOwnerDeletion=_B,
    )),
)  # fmt: skip
_RESOURCES = _object(
    limits={"type": "object", "additionalProperties": _QUANTITY},
    requests={"type": "object", "additionalProperties": _QUANTITY},
    claims=_map_list(["name"], _object(("name",), name=_S, request=_S)),
)
_CONTAINER = _object(
    ("name",), name=_S, image=_S, command=_STRINGS, args=_STRINGS, resources=_RESOURCES,
    securityContext=_object(privileged=_B, runAsNonRoot=_B, allowPrivilegeEscalation=_B,
                            readOnlyRootFilesystem=_B),
)  # fmt: skip
_VOLUME = _object(
    ("name",), name=_S, hostPath=_object(("path",), path=_S, type=_S),
    emptyDir=_object(medium=_S, sizeLimit=_QUANTITY), secret=_object(secretName=_S),
)  # fmt: skip
_TOLERATION = _object(key=_S, operator=_S, value=_S, effect=_S, tolerationSeconds=_I)
POD = _object(
    apiVersion=_S, kind=_S, metadata=OBJECT_META,
    spec=_object(
        ("containers",),
        containers=_map_list(["name"], _CONTAINER),
        initContainers=_map_list(["name"], _CONTAINER),
        ephemeralContainers=_map_list(["name"], _CONTAINER),
        resources=_RESOURCES,  # pod-level resources (PodLevelResources)
        volumes=_map_list(["name"], _VOLUME),
        priorityClassName=_S, priority={"type": "integer", "format": "int32"}, nodeName=_S,
        serviceAccountName=_S, automountServiceAccountToken=_B, nodeSelector=_LABELS,
        tolerations={"type": "array", "items": _TOLERATION}, hostNetwork=_B, hostPID=_B,
    ),
    status=_object(phase=_S, podIP=_S),
)  # fmt: skip
NODE = _object(
    apiVersion=_S, kind=_S, metadata=OBJECT_META,
    spec=_object(
        podCIDR=_S, podCIDRs=_STRINGS, providerID=_S, unschedulable=_B,
        taints={"type": "array", "items": _object(("key", "effect"), key=_S, value=_S,
                                                  effect=_S, timeAdded=_TIME)},
    ),
    status=_object(capacity={"type": "object", "additionalProperties": _QUANTITY},
                   allocatable={"type": "object", "additionalProperties": _QUANTITY}),
)  # fmt: skip
KINDS = {("", "v1", "pods"): POD, ("", "v1", "nodes"): NODE}


def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _crds() -> list[dict[str, Any]]:
    return [d for d in _documents("crds.yaml") if d["kind"] == "CustomResourceDefinition"]


def _policies() -> list[dict[str, Any]]:
    docs = _documents("admission-policy.yaml")
    return [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]


def _compile(rule: ct.CrdRule) -> Any:
    assert rule.self_type is not None
    return ct.compile_checked(
        rule.rule["rule"], {"self": rule.self_type, "oldSelf": rule.self_type}
    )


def _is_transition(checked: Any) -> bool:
    return any(ref.name == "oldSelf" for ref in checked.reference_map.values())


def test_every_crd_rule_compiles_against_the_types_the_api_server_declares() -> None:
    rules = [r for crd in _crds() for r in ct.crd_rules(crd)]
    shipped = (DEPLOY / "crds.yaml").read_text().count("- rule: ")
    assert len(rules) == shipped > 0  # every rule of the file, none skipped
    problems = []
    for rule in rules:
        where = f"{rule.kind} {rule.path}: {rule.rule['rule']!r}"
        if rule.self_type is None:
            problems.append(f"{where}: rule declared on a schema CEL cannot type")
            continue
        try:
            checked = _compile(rule)
        except ct.CelError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if ct.output_type(checked) != ct.BOOL_TYPE:
            problems.append(f"{where}: must evaluate to a bool")
        if _is_transition(checked) and not rule.correlatable:
            problems.append(f"{where}: oldSelf under a list that is not a map list")
    assert problems == []


def _pool_spec_schema() -> dict[str, Any]:
    crd = next(c for c in _crds() if c["spec"]["names"]["kind"] == "TokenPool")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return copy.deepcopy(spec)


OLD_MODEL_RULE = (
    'type(self.model) != string || self.model in ["Llama-3.1-70B", "Llama-3.1-8B", '
    '"Qwen3-8B", "SmolLM2-135M"]'
)


def test_the_old_model_rule_on_an_untyped_field_is_refused() -> None:
    """The schema and rule the CRD had: `model` was x-kubernetes-preserve-unknown-fields with no
    type (a name or a profile mapping), which the API server leaves out of CEL."""
    old = _pool_spec_schema()
    old["properties"]["model"] = {"x-kubernetes-preserve-unknown-fields": True}
    old["properties"].pop("customModel")
    typed = ct.decl_type(old)
    assert typed is not None and "model" not in typed.fields
    with pytest.raises(ct.CelError, match="undefined field 'model'"):
        ct.compile_checked(OLD_MODEL_RULE, {"self": typed, "oldSelf": typed})
    # int-or-string is dyn: the same rule compiles (and would refuse a profile mapping)
    old["properties"]["model"] = {"x-kubernetes-int-or-string": True}
    dyn = ct.decl_type(old)
    assert dyn is not None
    ct.compile_checked(OLD_MODEL_RULE, {"self": dyn, "oldSelf": dyn})
    # today's: a string, and a profile of its own in customModel
    now = ct.decl_type(_pool_spec_schema())
    assert now is not None and now.fields["model"].kind == "string"
    assert now.fields["customModel"].kind == "object"


def _checks(expression: str, typed: ct.Decl | None) -> bool:
    assert typed is not None
    try:
        ct.compile_checked(expression, {"self": typed})
    except ct.CelError:
        return False
    return True


def test_the_declarations_are_those_of_schema_decl_type() -> None:
    resource = {
        "type": "object",
        "properties": {
            "metadata": {"type": "object"},
            "spec": _object(
                name={"type": "string", "maxLength": 10},
                free={"x-kubernetes-preserve-unknown-fields": True},
                loose={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                port={"x-kubernetes-int-or-string": True},
                at=_TIME,
                counts={"type": "object", "additionalProperties": {"type": "integer"}},
                tags={"type": "array", "items": _S, "maxItems": 3},
                **{"x-y": _S, "namespace": _S},
            ),
        },
    }
    root = ct.decl_type(resource, root=True)
    assert _checks('self.metadata.name == "a" && self.metadata.generateName == ""', root)
    assert not _checks("has(self.metadata.labels)", root)  # metadata: name, generateName only
    assert _checks('self.kind == "K" && self.apiVersion == "v1"', root)
    spec = ct.decl_type(resource["properties"]["spec"])
    assert not _checks("has(self.free)", spec)  # no type: not in CEL
    assert _checks("has(self.loose)", spec) and not _checks("has(self.loose.x)", spec)
    assert _checks('self.port == 8080 || self.port == "http"', spec)  # int-or-string: dyn
    assert _checks('self.at > timestamp("2020-01-01T00:00:00Z")', spec)
    assert not _checks('self.at == "2020"', spec)  # date-time: a timestamp, not a string
    assert _checks('self.counts.all(k, self.counts[k] >= 0) && self.tags.all(t, t != "")', spec)
    assert not _checks('self.counts["a"].startsWith("x")', spec)
    assert _checks('self.x__dash__y == "" && self.__namespace__ == ""', spec)  # escaped names
    name = ct.decl_type(resource["properties"]["spec"]["properties"]["name"])
    assert _checks("self.size() <= 10", name) and not _checks("has(self.x)", name)  # self: string
    assert name is not None and name.max_elements == 40  # maxLength in runes, 4 bytes each
    assert not _checks("self.tags.exists(t, t == 1)", spec)  # a string list's items are strings
    assert not _checks('["a", 1].size() == 2', spec)  # homogeneous aggregate literals


def test_every_crd_rule_costs_less_than_the_api_server_allows() -> None:
    costs: list[tuple[str, int]] = []
    for crd in _crds():
        total = 0  # the CRD's: each rule's cost times the times it can run for one object
        for rule in ct.crd_rules(crd):
            assert rule.self_type is not None
            roots = {"self": rule.self_type, "oldSelf": rule.self_type}
            cost = ct.estimate_cost(_compile(rule), roots)
            costs.append((f"{rule.kind} {rule.path}: {rule.rule['rule']}", cost))
            total += cost * rule.cardinality
        assert total <= ct.STATIC_ESTIMATED_CRD_COST_LIMIT, (crd["metadata"]["name"], total)
    # the API server refuses a rule over STATIC_ESTIMATED_COST_LIMIT; PER_CALL_LIMIT, which
    # stops a rule at run time, is the stricter bound held here
    assert [(where, cost) for where, cost in costs if cost > ct.PER_CALL_LIMIT] == []
    assert len(costs) == (DEPLOY / "crds.yaml").read_text().count("- rule: ")


def _key_hash_rule() -> tuple[dict[str, Any], str]:
    crd = next(c for c in _crds() if c["spec"]["names"]["kind"] == "TokenEntitlement")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rule = next(r["rule"] for r in spec["x-kubernetes-validations"] if "apiKeyHashes" in r["rule"])
    return copy.deepcopy(spec), rule


def test_the_cost_of_a_comprehension_is_bounded_by_the_schema() -> None:
    spec, rule = _key_hash_rule()
    hashes = spec["properties"]["apiKeyHashes"]
    assert (hashes["maxItems"], hashes["items"]["maxLength"]) == (64, 71)
    typed = ct.decl_type(spec)
    assert typed is not None
    # cel-go's arithmetic: `!has(..)` 2; range 2, result 1; per item: loop condition 2, step
    # `@result && h.matches(p)` 1 + 1 + ceil((4*71 + 1) * 0.1) * ceil(len(p) * 0.25) = 2 + 29*6
    per_item = 2 + 2 + 29 * 6
    cost = ct.estimate_cost(ct.compile_checked(rule, {"self": typed}), {"self": typed})
    assert cost == 2 + 2 + 1 + 64 * per_item
    # without the bounds the API server would refuse the rule, and so the CRD
    del hashes["maxItems"], hashes["items"]["maxLength"]
    unbounded = ct.decl_type(spec)
    assert unbounded is not None
    checked = ct.compile_checked(rule, {"self": unbounded})
    assert ct.estimate_cost(checked, {"self": unbounded}) > ct.STATIC_ESTIMATED_COST_LIMIT


def test_the_admission_policies_compile_as_the_api_server_compiles_them() -> None:
    policies = _policies()
    assert policies
    for policy in policies:
        name = policy["metadata"]["name"]
        # admitting the policy: object and oldObject dyn, request and namespaceObject typed
        assert ct.policy_problems(policy, ct.DYN) == [], name
        resources = ct.matched_resources(policy)
        assert resources and set(resources) <= set(KINDS), (name, resources)
        for resource in resources:  # the type check against each kind the policy matches
            kind = ct.decl_type(KINDS[resource], root=True)
            assert kind is not None
            assert ct.policy_problems(policy, kind) == [], (name, resource)


def test_a_policy_that_reads_what_its_kind_lacks_is_caught() -> None:
    policy = copy.deepcopy(_policies()[0])
    assert ("", "v1", "pods") in ct.matched_resources(policy)
    pod, node = (ct.decl_type(KINDS[("", "v1", r)], root=True) for r in ("pods", "nodes"))
    assert pod is not None and node is not None
    policy["spec"]["validations"].append(
        {"expression": 'object.spec.nodeNmae == ""', "message": "typo"}
    )
    assert ct.policy_problems(policy, ct.DYN) == []  # dyn: the API server admits it...
    (problem,) = ct.policy_problems(policy, pod)  # ...and its type check finds it
    assert "undefined field 'nodeNmae'" in problem
    policy["spec"]["validations"][-1]["expression"] = 'object.spec.nodeName == ""'
    assert ct.policy_problems(policy, pod) == []
    assert ct.policy_problems(policy, node)  # a Node has no spec.nodeName
    policy["spec"]["validations"][-1]["expression"] = 'request.userInfo.usernam == ""'
    assert ct.policy_problems(policy, ct.DYN)  # request is typed even when object is not
    policy["spec"]["validations"][-1]["expression"] = "object.spec.priority"
    assert ct.policy_problems(policy, ct.DYN)  # dyn is not a bool
