"""The llm-d InferenceObjectives a pool's classes become: what `render` and the operator emit
agrees with model/objectives.py (the names the ext_proc processor sends, the priorities) for
generated pools, validates against the kind's schema as llm-d's CRD states it, keeps the
paper's order as llm-d's bands; and the operator makes them, owns them, adopts what `render`
applied, follows edits, never takes over a foreign object, and does without the kind."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.kube.apiserver import RESOURCES
from tests.kube.harness import NS, PLATFORM, Bench, bench, ent, pool
from tokenpools.cli import app
from tokenpools.k8s.api import ENTITLEMENTS, POOLS
from tokenpools.k8s.custom_resources import render
from tokenpools.k8s.inference_objectives import (
    LEGACY,
    LLM_D,
    MANAGED_BY,
    inference_objectives,
    objective_kind,
)
from tokenpools.k8s.names import label_value
from tokenpools.k8s.schema import OBJECT_NAME, InferencePoolRef
from tokenpools.model.objectives import OBJECTIVE_HEADER, PRIORITY, objective_name
from tokenpools.model.service_class import ServiceClass
from tokenpools.shipped import EXAMPLE_CONFIG

__all__ = ["bench"]  # the fixture

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
OBJECTIVES = objective_kind(LLM_D)
# The kind's spec as llm-d's CRD declares it (llm-d/llm-d-router,
# config/crd/bases/llm-d.ai_inferenceobjectives.yaml; the legacy group's v1alpha2 is the same),
# restated as JSON Schema; unknown fields refused, as the API server's strict validation does.
SPEC = {
    "type": "object",
    "required": ["poolRef"],
    "additionalProperties": False,
    "properties": {
        "priority": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
        "poolRef": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "group": {
                    "type": "string",
                    "maxLength": 253,
                    "pattern": r"^$|^" + OBJECT_NAME[1:],
                },
                "kind": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 63,
                    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                },
                "name": {"type": "string", "minLength": 1, "maxLength": 253},
            },
        },
    },
}

# TokenPool names (DNS subdomains) and what a config file may call a pool (any text that fits
# an object name's length: `render` emits the TokenPool under it)
_LABEL = r"[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?"
_SUBDOMAIN = st.from_regex(rf"\A{_LABEL}(\.{_LABEL}){{0,3}}\Z")
POOL_NAMES = st.one_of(_SUBDOMAIN, st.text(min_size=1, max_size=253))
POOL_REFS = st.one_of(
    st.none(),
    st.builds(
        InferencePoolRef,
        group=st.sampled_from(["inference.networking.k8s.io", "inference.networking.x-k8s.io"]),
        name=_SUBDOMAIN,
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    name=POOL_NAMES,
    other=POOL_NAMES,
    ref=POOL_REFS,
    api=st.sampled_from([LLM_D, LEGACY]),
)
def test_objectives_agree_with_the_declaration_for_every_class(
    name: str, other: str, ref: InferencePoolRef | None, api: str
) -> None:
    made = inference_objectives(name, PLATFORM, ref, api)
    assert [o["metadata"]["labels"]["tokenpools.io/service-class"] for o in made] == [
        c.value for c in ServiceClass
    ]
    validator = jsonschema.Draft7Validator(SPEC)
    for objective, service_class in zip(made, ServiceClass, strict=True):
        meta, spec = objective["metadata"], objective["spec"]
        # the name the processor sends in x-llm-d-inference-objective, a valid object name
        assert meta["name"] == objective_name(name, service_class), OBJECTIVE_HEADER
        assert DNS_LABEL.match(meta["name"]), meta["name"]
        assert spec["priority"] == PRIORITY[service_class]
        assert spec["poolRef"] == {
            "group": ref.group if ref else "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": ref.name if ref else name,
        }
        assert (objective["apiVersion"], objective["kind"], meta["namespace"]) == (
            api, "InferenceObjective", PLATFORM
        )  # fmt: skip
        assert all(LABEL_VALUE.match(v) and len(v) <= 63 for v in meta["labels"].values())
        assert meta["labels"]["tokenpools.io/pool"] == label_value(name)
        assert not list(validator.iter_errors(spec))
    # one name per pool and class: the picker keys objectives by name alone
    names = {o["metadata"]["name"] for o in made}
    assert len(names) == len(ServiceClass)
    if other != name:
        assert not names & {o["metadata"]["name"] for o in inference_objectives(other, PLATFORM)}


def test_priorities_keep_the_papers_order_as_llm_d_bands() -> None:
    document = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    objectives = [o for o in render(document) if o["kind"] == "InferenceObjective"]
    assert len(objectives) == len(document["pools"]) * len(ServiceClass)
    band = {
        o["metadata"]["labels"]["tokenpools.io/service-class"]: o["spec"]["priority"]
        for o in objectives
    }
    assert band["dedicated"] == band["guaranteed"] > band["elastic"] > band["spot"]
    assert band["spot"] > band["preemptible"]
    # llm-d may shed negative bands under saturation: exactly the classes the paper lets go
    assert band["elastic"] >= 0 > band["spot"]
    assert {k for k, v in band.items() if v < 0} == {"spot", "preemptible"}


def test_render_and_the_objectives_command() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["k8s", "render", str(EXAMPLE_CONFIG)])
    assert out.exit_code == 0, out.output
    kinds = [d["kind"] for d in yaml.safe_load_all(out.stdout) if d]
    assert kinds.count("InferenceObjective") == kinds.count("TokenPool") * len(ServiceClass)
    out = runner.invoke(app, ["k8s", "render", str(EXAMPLE_CONFIG), "--no-objectives"])
    assert "InferenceObjective" not in out.stdout
    out = runner.invoke(
        app,
        ["k8s", "objectives", str(EXAMPLE_CONFIG), "--namespace", "llm",
         "--objective-api", LEGACY],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {(d["kind"], d["apiVersion"], d["metadata"]["namespace"]) for d in docs} == {
        ("InferenceObjective", LEGACY, "llm")
    }
    pools = yaml.safe_load(EXAMPLE_CONFIG.read_text())["pools"]
    assert len(docs) == len(pools) * len(ServiceClass)


# -- the operator ------------------------------------------------------------------------


def _objectives(bench: Bench, api: str = LLM_D) -> dict[str, Any]:
    found = bench.kube.list(objective_kind(api), PLATFORM)
    return {o["metadata"]["name"]: o for o in found}


def _writes(bench: Bench) -> list[tuple[str, str, str | None, int]]:
    return [w for w in bench.server.api.writes if w[1] == "inferenceobjectives"]


def test_the_operator_makes_owns_and_follows_each_pools_objectives(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    kube.create(POOLS, None, pool("llama", servedModels=["llama"]))
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    bench.settle()
    uid = kube.get(POOLS, None, "qwen")["metadata"]["uid"]
    made = _objectives(bench)
    assert len(made) == 2 * len(ServiceClass)
    for cls in ServiceClass:  # all five, though the pool has one guaranteed entitlement
        objective = made[objective_name("qwen", cls)]
        assert objective["spec"]["priority"] == PRIORITY[cls]
        assert objective["spec"]["poolRef"]["name"] == "qwen"
        [owner] = objective["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "TokenPool", "qwen", uid, True
        )  # fmt: skip
        assert objective["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tokenpools"

    # settled: another pass writes nothing
    before = len(_writes(bench))
    bench.settle()
    assert len(_writes(bench)) == before

    # another InferencePool: the five are patched, not recreated
    kube.patch(POOLS, None, "qwen", {"spec": {"inferencePoolRef": {"name": "qwen-pool"}}})
    bench.settle()
    after = _objectives(bench)
    for cls in ServiceClass:
        name = objective_name("qwen", cls)
        assert after[name]["spec"]["poolRef"]["name"] == "qwen-pool"
        assert after[name]["metadata"]["uid"] == made[name]["metadata"]["uid"]
    assert {w[0] for w in _writes(bench)[before:]} == {"patch"}

    # an objective edited by hand is put back on the next pass
    name = objective_name("qwen", ServiceClass.SPOT)
    kube.patch(OBJECTIVES, PLATFORM, name, {"spec": {"priority": 10}})
    bench.settle()
    assert _objectives(bench)[name]["spec"]["priority"] == PRIORITY[ServiceClass.SPOT]

    # the pool deleted: its objectives go with it (no garbage collector in the stand-in)
    kube.delete(POOLS, None, "llama")
    bench.settle()
    left = _objectives(bench)
    assert len(left) == len(ServiceClass)
    assert all(n.startswith("qwen-") for n in left)


def test_the_operator_adopts_what_render_applied_and_never_takes_a_foreign_one(
    bench: Bench,
) -> None:
    kube = bench.kube
    rendered = inference_objectives("qwen", PLATFORM)  # as `k8s render | kubectl apply` made it
    for objective in rendered[:2]:
        kube.create(OBJECTIVES, PLATFORM, objective)
    foreign = objective_name("qwen", ServiceClass.SPOT)
    kube.create(OBJECTIVES, PLATFORM, {"metadata": {"name": foreign},
                "spec": {"priority": 50, "poolRef": {"name": "someone-elses"}}})  # fmt: skip
    kube.create(POOLS, None, pool())
    bench.settle()
    made = _objectives(bench)
    uid = kube.get(POOLS, None, "qwen")["metadata"]["uid"]
    for objective in rendered[:2]:  # adopted: the same object, now owned by the pool
        got = made[objective["metadata"]["name"]]
        assert got["metadata"]["ownerReferences"][0]["uid"] == uid
    assert made[foreign]["spec"]["priority"] == 50  # untouched
    assert "ownerReferences" not in made[foreign]["metadata"]
    status = kube.get(POOLS, None, "qwen")["status"]
    reconciled = next(c for c in status["conditions"] if c["type"] == "Reconciled")
    assert reconciled["status"] == "False" and foreign in reconciled["message"]
    # the node and the other objectives were made all the same
    assert status["nodeName"] and len(made) == len(ServiceClass)

    # handed over by label: the operator takes it and the pool reconciles
    kube.patch(OBJECTIVES, PLATFORM, foreign, {"metadata": {"labels": MANAGED_BY}})
    bench.clock.now += 600  # past the backoff
    bench.settle()
    assert _objectives(bench)[foreign]["spec"]["priority"] == PRIORITY[ServiceClass.SPOT]
    status = kube.get(POOLS, None, "qwen")["status"]
    assert next(c for c in status["conditions"] if c["type"] == "Reconciled")["status"] == "True"


@pytest.mark.parametrize("served", [[LLM_D, LEGACY], [LEGACY], []])
def test_the_operator_writes_where_the_cluster_serves_the_kind(
    bench: Bench, served: list[str]
) -> None:
    everywhere = {k for k in RESOURCES if k[1] == "inferenceobjectives"}
    bench.server.api.unserved = {k for k in everywhere if k[0] not in served}
    bench.kube.create(POOLS, None, pool())
    bench.settle()
    status = bench.kube.get(POOLS, None, "qwen")["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert not any(c["type"] == "Reconciled" and c["status"] == "False"
                   for c in status["conditions"])  # fmt: skip
    wrote = {w[1] for w in bench.server.api.writes if w[1] == "inferenceobjectives"}
    if not served:  # no llm-d here: nothing to write, nothing wrong
        assert not wrote
        return
    bench.server.api.unserved = set()  # to read back what was written, and where
    assert len(_objectives(bench, served[0])) == len(ServiceClass)
    for other in served[1:]:
        assert _objectives(bench, other) == {}  # llm-d reads its own group first


def test_a_failing_objectives_api_fails_the_pool_only_and_is_retried(bench: Bench) -> None:
    from tests.kube.api_faults import Fault

    api = bench.server.api
    api.faults[:] = [Fault("create", "inferenceobjectives", None, status=500)]
    bench.kube.create(POOLS, None, pool())
    bench.kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    bench.settle()
    assert bench.states() == {"gold": "Bound"}  # the node was made, the lease bound
    status = bench.kube.get(POOLS, None, "qwen")["status"]
    reconciled = next(c for c in status["conditions"] if c["type"] == "Reconciled")
    assert reconciled["status"] == "False" and "500" in reconciled["message"]
    api.faults[:] = []
    bench.clock.now += 600
    bench.settle()
    assert len(_objectives(bench)) == len(ServiceClass)


def test_an_object_whose_reconcile_keeps_failing_is_retried_one_second_doubling_to_five_minutes(
    bench: Bench,
) -> None:
    """Each failure in a row waits twice as long as the one before, from 1 s up to 5 min, and
    the pool is not tried again before its time (an API server in trouble is not hammered)."""
    from tests.kube.api_faults import Fault

    bench.server.api.faults[:] = [Fault("create", "inferenceobjectives", None, status=500)]
    bench.kube.create(POOLS, None, pool())
    registry = bench.rec.metrics.registry

    def failures() -> float:
        labels = {"kind": "TokenPool", "result": "error"}
        return registry.get_sample_value("tokenpools_operator_reconciles_total", labels) or 0.0

    bench.rec.reconcile()
    assert failures() == 1
    for wait_s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300):
        before = failures()
        bench.clock.now += wait_s - 0.01
        bench.rec.reconcile()
        assert failures() == before, f"tried again before {wait_s} s"
        bench.clock.now += 0.01
        bench.rec.reconcile()
        assert failures() == before + 1, f"not tried again after {wait_s} s"
