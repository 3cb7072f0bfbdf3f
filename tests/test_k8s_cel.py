"""The CEL the API server runs for us, evaluated here with a CEL library: the CRDs' rules agree
with the config schema on generated specs, and the ValidatingAdmissionPolicy refuses pods that
take tokenpools capacity by hand and any pod but a lease pod from the operator."""

from __future__ import annotations

from typing import Any

from cel import cel  # the compiled module: xds-protos' own top-level `cel` may empty __init__
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kube.admission import OPERATOR, refusals
from tokenpools.k8s import objects as o
from tokenpools.k8s.crds import crds
from tokenpools.k8s.custom_resources import check_spec, config_data, render
from tokenpools.model.profile import BUILTIN_PROFILES
from tokenpools.model.service_class import ServiceClass


def _spec_schema(kind: str) -> dict[str, Any]:
    crd = next(c for c in crds() if c["spec"]["names"]["kind"] == kind)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def cel_refuses(kind: str, spec: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """The messages of the CRD's CEL rules that fail for `spec` (as the API server runs them:
    on the spec, and on each field that has rules, with oldSelf on an update)."""
    schema, out = _spec_schema(kind), []
    targets = [(schema, spec, old)]
    for name, prop in schema["properties"].items():
        if "x-kubernetes-validations" in prop and name in spec:
            targets.append((prop, spec[name], None if old is None else old.get(name)))
    for node, value, before in targets:
        for rule in node.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"] and before is None:
                continue  # transition rules run on updates only
            ctx = {"self": value, **({"oldSelf": before} if before is not None else {})}
            if not cel.evaluate(rule["rule"], ctx):
                out.append(rule["message"])
    return out


def _pool_specs() -> st.SearchStrategy[dict[str, Any]]:
    models = st.sampled_from([*BUILTIN_PROFILES, "qwen3-8b", "Qwen3-8B ", "gpt-5"])
    counts = st.integers(0, 5)
    per = st.fixed_dictionaries(
        {},
        optional={
            "tokensPerSecond": st.just(240),
            "concurrency": st.just(8),
            "kvTokens": st.just(16384),
            "kvCacheGiB": st.just(2.0),
        },
    )
    profile = {"name": "own", "layers": 32, "kvHeads": 8, "headDim": 128}
    return st.fixed_dictionaries(
        {"perReplica": per},
        optional={
            "model": models,
            "customModel": st.just(profile),  # one of the two (k8s/schema.py ModelChoice)
            "replicas": counts,
            "minReplicas": counts,
            "maxReplicas": counts,
        },
    )


@settings(max_examples=300, deadline=None)
@given(spec=_pool_specs())
def test_pool_rules_agree_with_the_config_schema(spec: dict[str, Any]) -> None:
    refused_by_cel = bool(cel_refuses("TokenPool", spec))
    refused_by_schema = check_spec("TokenPool", spec, "", "p") is not None
    assert refused_by_cel == refused_by_schema, (spec, cel_refuses("TokenPool", spec))


@settings(max_examples=200, deadline=None)
@given(
    kv=st.fixed_dictionaries({}, optional={"kvTokens": st.just(100), "kvCacheGiB": st.just(1.0)}),
    keys=st.lists(
        st.sampled_from(
            [
                "sha256:" + "a" * 64,
                "sha256:" + "A" * 64,
                "sha256:00",
                "sk-plain",
                "sha256:" + "0" * 64,
            ]
        ),
        max_size=3,
    ),
)
def test_entitlement_rules_agree_with_the_config_schema(
    kv: dict[str, Any], keys: list[str]
) -> None:
    spec = {"pool": "p", "serviceClass": "guaranteed", "concurrency": 2, **kv}
    if keys:
        spec["apiKeyHashes"] = keys
    refused_by_cel = bool(cel_refuses("TokenEntitlement", spec))
    assert refused_by_cel == (check_spec("TokenEntitlement", spec, "t", "e") is not None), spec


def test_a_pool_names_a_built_in_profile_or_brings_its_own() -> None:
    """`model` is a string the API server can type (tests/test_k8s_cel_types.py); a profile of
    the pool's own goes in `customModel`, and becomes the config's `model` mapping."""
    own = {"name": "mine", "layers": 2, "kvHeads": 2, "headDim": 64, "bytesPerElement": 2.0}
    per = {"tokensPerSecond": 100, "concurrency": 4, "kvTokens": 1000}
    document = {"pools": [{"name": "p", "model": own, "perReplica": per}], "entitlements": []}
    (pool,) = [o for o in render(document, None) if o["kind"] == "TokenPool"]
    assert "model" not in pool["spec"] and pool["spec"]["customModel"] == own
    assert cel_refuses("TokenPool", pool["spec"]) == []
    assert check_spec("TokenPool", pool["spec"], "", "p") is None
    built = config_data([pool], [])
    assert not built.problems and built.data["pools"][0]["model"] == own
    both = {**pool["spec"], "model": "Qwen3-8B"}
    assert cel_refuses("TokenPool", both) == [
        "give model (a built-in profile) or customModel, one of the two"
    ]
    assert check_spec("TokenPool", both, "", "p") is not None
    # a pool stored before customModel, its profile in `model`, is still read
    stored = {**pool, "spec": {"model": own, "perReplica": per}}
    assert config_data([stored], []).data["pools"][0]["model"] == own


def test_the_pool_of_an_entitlement_is_immutable() -> None:
    spec = {"pool": "p", "serviceClass": "elastic", "concurrency": 1}
    assert cel_refuses("TokenEntitlement", spec, old=spec) == []
    moved = cel_refuses("TokenEntitlement", {**spec, "pool": "q"}, old=spec)
    assert moved == ["pool is immutable; create a new entitlement"]


def _policy_allows(pod: dict[str, Any], user: str) -> list[str]:
    return refusals("tokenpools-lease-pods", "CREATE", "pods", pod, None, user)


def test_the_admission_policy_keeps_capacity_to_the_operators_lease_pods() -> None:
    ent = {"metadata": {"name": "e", "namespace": "t", "uid": "u"}, "spec": {"pool": "p"}}
    lease = o.lease_pod(ent, ServiceClass.GUARANTEED, {"tokenpools.io/concurrency": 2})
    assert _policy_allows(lease, OPERATOR) == []
    assert _policy_allows(lease, "alice") == [
        "only the tokenpools operator may create pods that hold tokenpools capacity",
        "only the tokenpools operator may mark a pod as a lease pod (the tokenpools.io/lease "
        "label, the tokenpools.io/made-by annotation, a TokenEntitlement owner)",
    ]
    by_hand = {"metadata": {}, "spec": {"priorityClassName": "tokenpools-dedicated",
                                        "containers": [{"image": "x"}]}}  # fmt: skip
    assert _policy_allows(by_hand, "alice")
    plain = {"metadata": {}, "spec": {"containers": [{"image": "busybox"}]}}
    assert _policy_allows(plain, "alice") == []
    assert _policy_allows(plain, OPERATOR) == ["the tokenpools operator may create lease pods only"]
    mounted = {**lease, "spec": {**lease["spec"], "volumes": [{"name": "v", "hostPath": {}}]}}
    assert _policy_allows(mounted, OPERATOR)
