"""Edits never revoke silently. Against the API stand-in, each platform edit that used to take a
binding away at once now leaves Bound tenants Bound, or is refused by the webhook with the list
of entitlements it would affect:

- a pool's namespaceSelector edited to miss a tenant's namespace (or the namespace's label
  taken away): refused by the webhook with the affected list unless acknowledged; when it gets
  through, the Bound entitlements keep their binding for the grace period, with `Revoking`
  saying why and until when, and lose it only after;
- a served model name another pool serves: refused, and the pool that serves it keeps it;
- a key hash another entitlement holds: refused, and the holder keeps it; the gateway's key
  map never moves the holder's key to the claimant.

The webhook reads all of it from its watch caches: no admission lists the cluster."""

from __future__ import annotations

from typing import Any

import pytest

from tests.kube.harness import NS, PLATFORM, TENANT_LABEL, Bench, bench, ent, pool
from tests.servers import wait_until
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, EVENTS, NAMESPACES, PODS, POOLS
from tokenpools.k8s.grace import DEFAULT_GRACE_S, REVOKING
from tokenpools.k8s.reconciler import Reconciler
from tokenpools.k8s.revocations import ACKNOWLEDGE
from tokenpools.k8s.source import cluster_config
from tokenpools.k8s.webhook import review
from tokenpools.k8s.webhook_cache import CachedLookup
from tokenpools.model.entitlement import BindingState
from tokenpools.model.keys import hash_key

__all__ = ["bench"]

KEY = hash_key("sk-gold")
CLOSED = {"matchLabels": {"tokenpools.io/tenant": "nobody"}}  # the typo: matches no namespace


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def _lease_uids(bench: Bench, name: str, ns: str = NS) -> list[str]:
    return [p["metadata"]["uid"] for p in bench.leases(name, ns)]


def _gateway(bench: Bench) -> Any:
    """The config the gateway builds from what the operator wrote."""
    return cluster_config(bench.kube.list(POOLS), bench.kube.list(ENTITLEMENTS), [])


def _close(bench: Bench, how: str) -> None:
    if how == "selector edited":
        bench.kube.patch(POOLS, None, "qwen", {"spec": {"namespaceSelector": CLOSED}})
    else:
        bench.kube.patch(
            NAMESPACES, None, NS, {"metadata": {"labels": {"tokenpools.io/tenant": None}}}
        )


def _open(bench: Bench, how: str) -> None:
    if how == "selector edited":
        selector = {"matchLabels": TENANT_LABEL}
        bench.kube.patch(POOLS, None, "qwen", {"spec": {"namespaceSelector": selector}})
    else:
        bench.kube.patch(NAMESPACES, None, NS, {"metadata": {"labels": TENANT_LABEL}})


@pytest.mark.parametrize("how", ["selector edited", "namespace label removed"])
def test_a_closed_pool_keeps_bound_tenants_bound_for_the_grace_period(
    bench: Bench, how: str
) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 4))
    kube.create(ENTITLEMENTS, NS, ent("late", "elastic", 1))
    bench.settle()
    assert bench.states() == {"gold": "Bound", "late": "Bound"}
    leases = _lease_uids(bench, "gold")

    _close(bench, how)
    bench.settle()
    start = bench.clock.now
    assert bench.states() == {"gold": "Bound", "late": "Bound"}  # nothing taken at once
    assert _lease_uids(bench, "gold") == leases
    gold = kube.get(ENTITLEMENTS, NS, "gold")
    revoking = _conditions(gold)[REVOKING]
    assert (
        revoking["status"] == "True"
        and "is not open to namespace 'tenants'" in (revoking["message"])
    )
    assert o.iso(start + DEFAULT_GRACE_S) in revoking["message"]  # until when
    qwen = _conditions(kube.get(POOLS, None, "qwen"))[REVOKING]
    assert qwen["status"] == "True" and "tenants/gold, tenants/late" in qwen["message"]
    warnings = [e for e in kube.list(EVENTS, NS) if e["reason"] == REVOKING]
    assert len(warnings) == 2 and all(e["type"] == "Warning" for e in warnings)
    assert _gateway(bench).bindings["tenants/gold"] == BindingState.BOUND  # still admitted

    # an operator restarted half-way keeps the same deadline (it is in the status)
    bench.clock.now += DEFAULT_GRACE_S / 2
    bench.rec = Reconciler(kube, bench.clock, PLATFORM)
    bench.settle()
    assert bench.states() == {"gold": "Bound", "late": "Bound"}
    assert (
        _conditions(kube.get(ENTITLEMENTS, NS, "gold"))[REVOKING]["message"]
        == (revoking["message"])
    )

    # the typo undone within the grace period: nothing happened
    _open(bench, how)
    bench.settle()
    gold = kube.get(ENTITLEMENTS, NS, "gold")
    assert _conditions(gold)[REVOKING]["status"] == "False"
    assert _conditions(gold)["SpecAccepted"]["status"] == "True"
    assert bench.states() == {"gold": "Bound", "late": "Bound"}
    assert _lease_uids(bench, "gold") == leases

    # closed again and left so: the binding goes only once the grace period is over
    _close(bench, how)
    bench.settle()
    bench.clock.now += DEFAULT_GRACE_S - 1
    bench.settle()
    assert bench.states() == {"gold": "Bound", "late": "Bound"}
    bench.clock.now += 2
    bench.settle()
    assert bench.states() == {"gold": "Invalid", "late": "Invalid"}
    assert bench.leases("gold") == []
    assert "tenants/gold" not in _gateway(bench).entitlements


def test_a_lease_pod_lost_during_the_grace_period_does_not_end_it(bench: Bench) -> None:
    """Evicted during the grace (its node shrunk, a drain): the entitlement is not Bound for a
    while, and keeps its deadline rather than losing its binding at once."""
    kube = bench.kube
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 4))
    bench.settle()
    _close(bench, "selector edited")
    bench.settle()
    message = _conditions(kube.get(ENTITLEMENTS, NS, "gold"))[REVOKING]["message"]
    bench.clock.now += DEFAULT_GRACE_S / 2
    [lease] = bench.leases("gold")
    kube.delete(PODS, NS, lease["metadata"]["name"], grace_s=0)  # evicted
    for _ in range(3):  # the operator alone: the replacement waits for the scheduler
        bench.rec.reconcile()
        assert bench.states()["gold"] != "Invalid"
    assert bench.states()["gold"] in ("Pending", "Degraded")  # not Bound, yet not revoked
    gold = kube.get(ENTITLEMENTS, NS, "gold")
    assert _conditions(gold)[REVOKING]["status"] == "True"
    assert _conditions(gold)[REVOKING]["message"] == message  # the same deadline
    bench.settle()
    assert bench.states() == {"gold": "Bound"}
    bench.clock.now += DEFAULT_GRACE_S / 2 - 1
    bench.settle()
    assert bench.states() == {"gold": "Bound"}
    bench.clock.now += 2  # and it still ends when it was to end
    bench.settle()
    assert bench.states() == {"gold": "Invalid"} and bench.leases("gold") == []


def test_the_grace_period_is_the_operators_setting(bench: Bench) -> None:
    kube = bench.kube
    bench.rec = Reconciler(kube, bench.clock, PLATFORM, binding_grace_s=60)
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 4))
    bench.settle()
    _close(bench, "selector edited")
    bench.settle()
    bench.clock.now += 59
    bench.settle()
    assert bench.states() == {"gold": "Bound"}
    bench.clock.now += 2
    bench.settle()
    assert bench.states() == {"gold": "Invalid"}


def test_a_served_model_another_pool_serves_stays_with_it(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())  # the older pool: it would have won the name before
    kube.create(POOLS, None, pool("llama", servedModels=["chat"]))
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 4))
    kube.create(ENTITLEMENTS, NS, {**ent("team", "guaranteed", 4), "spec": {
        "pool": "llama", "serviceClass": "guaranteed", "concurrency": 4}})  # fmt: skip
    bench.settle()
    assert bench.states() == {"gold": "Bound", "team": "Bound"}
    team_leases = _lease_uids(bench, "team")

    kube.patch(POOLS, None, "qwen", {"spec": {"servedModels": ["qwen", "chat"]}})  # the typo
    bench.settle()
    assert bench.states() == {"gold": "Bound", "team": "Bound"}
    assert _lease_uids(bench, "team") == team_leases
    qwen = kube.get(POOLS, None, "qwen")
    accepted = _conditions(qwen)["SpecAccepted"]
    assert accepted["status"] == "False"
    assert "'chat' is already served by TokenPool 'llama'" in accepted["message"]
    assert "servedModels" not in qwen["status"]["appliedSpec"]  # qwen runs on what it had
    assert _conditions(kube.get(POOLS, None, "llama"))["SpecAccepted"]["status"] == "True"
    served = {p.name: p.served_models for p in _gateway(bench).pools.values()}
    assert served == {"qwen": (), "llama": ("chat",)}  # the route to llama stays


def test_a_key_hash_stays_with_the_entitlement_that_holds_it(bench: Bench) -> None:
    kube = bench.kube
    bench.namespace("other", TENANT_LABEL)
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, "other", ent("thief", "elastic", 1))  # older, and sorts first
    bench.settle()
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 4, apiKeyHashes=[KEY]))
    bench.settle()
    assert bench.states() == {"gold": "Bound"} and bench.states("other") == {"thief": "Bound"}

    kube.patch(ENTITLEMENTS, "other", "thief", {"spec": {"apiKeyHashes": [KEY]}})  # the claim
    bench.settle()
    assert bench.states() == {"gold": "Bound"} and bench.states("other") == {"thief": "Bound"}
    gold, thief = kube.get(ENTITLEMENTS, NS, "gold"), kube.get(ENTITLEMENTS, "other", "thief")
    assert gold["status"]["appliedSpec"]["apiKeyHashes"] == [KEY]
    assert "apiKeyHashes" not in thief["status"]["appliedSpec"]
    refused = _conditions(thief)["SpecAccepted"]
    assert (
        refused["status"] == "False"
        and "already used by another entitlement" in (refused["message"])
    )
    assert "gold" not in refused["message"] and NS not in refused["message"]  # no one named
    holders = [n for n, e in _gateway(bench).entitlements.items() if KEY in e.api_key_hashes]
    assert holders == ["tenants/gold"]  # the gateway maps the key to its holder only


# -- the webhook, from its watch caches --------------------------------------------------------


def _review(kind: str, obj: dict[str, Any], op: str = "UPDATE", ns: str = "") -> dict[str, Any]:
    request = {"uid": "1", "kind": {"kind": kind}, "operation": op, "namespace": ns,
               "name": obj["metadata"]["name"], "object": obj}  # fmt: skip
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def _answer(lookup: CachedLookup, body: dict[str, Any]) -> str | None:
    response = review(body, lookup)["response"]
    return None if response["allowed"] else str(response["status"]["message"])


def test_the_webhook_names_what_a_pool_edit_would_unbind(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    kube.create(POOLS, None, pool("llama", servedModels=["chat"]))
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 4, apiKeyHashes=[KEY]))
    kube.create(ENTITLEMENTS, NS, ent("spare", "spot", 1))
    bench.settle()
    assert bench.states() == {"gold": "Bound", "spare": "Bound"}
    lookup = CachedLookup(kube).start()
    try:
        assert lookup.ready()
        wait_until(
            lambda: (
                len(lookup.entitlements()) == 2
                and all(
                    (e.get("status") or {}).get("state") == "Bound" for e in lookup.entitlements()
                )
            )
        )
        gold = kube.get(ENTITLEMENTS, NS, "gold")
        asked = len(list(bench.server.api))
        edited = pool(namespaceSelector=CLOSED)
        why = _answer(lookup, _review("TokenPool", edited))
        assert why is not None and "would unbind 2 Bound entitlements" in why
        assert "tenants/gold, tenants/spare" in why and ACKNOWLEDGE in why
        # acknowledged: exactly those, or all
        partly = {**edited, "metadata": {"name": "qwen", "annotations": {
            ACKNOWLEDGE: "tenants/gold"}}}  # fmt: skip
        assert "tenants/spare" in (_answer(lookup, _review("TokenPool", partly)) or "")
        for ack in ("tenants/gold,tenants/spare", "*"):
            meta = {"name": "qwen", "annotations": {ACKNOWLEDGE: ack}}
            assert _answer(lookup, _review("TokenPool", {**edited, "metadata": meta})) is None
        # an edit that unbinds no one needs nothing
        wider = pool(namespaceSelector={})
        assert _answer(lookup, _review("TokenPool", wider)) is None
        # a served model of another pool
        greedy = pool(servedModels=["qwen", "chat"])
        assert "'chat' is already served by TokenPool 'llama'" in (
            _answer(lookup, _review("TokenPool", greedy)) or ""
        )
        # a key hash another entitlement holds, from any namespace
        claim = ent("thief", "elastic", 1, apiKeyHashes=[KEY])
        claim["metadata"]["namespace"] = NS
        why = _answer(lookup, _review("TokenEntitlement", claim, "CREATE", NS))
        assert why is not None and "already used by another entitlement" in why
        assert _answer(lookup, _review("TokenEntitlement", gold, "UPDATE", NS)) is None
        # none of it asked the API server anything (the caches' watches aside)
        since = list(bench.server.api)[asked:]
        assert [r.url for r in since if r.params.get("watch") != "true"] == []
    finally:
        lookup.stop()


# -- the webhook judges the edit (oldObject against object), not the cluster's state -----------

TEAM_B = "team-b"


def _edit(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    body = _review("TokenPool", new)
    body["request"]["oldObject"] = old
    return body


def _annotated(obj: dict[str, Any], **annotations: str) -> dict[str, Any]:
    return {**obj, "metadata": {**obj["metadata"], "annotations": annotations}}


@pytest.fixture
def two_tenants(bench: Bench) -> Any:
    """qwen open to every namespace, gold Bound in the tenants namespace and blue in team-b;
    llama serving "chat"; the webhook's caches."""
    kube = bench.kube
    bench.namespace(TEAM_B, {"team": "b"})
    kube.create(POOLS, None, pool(namespaceSelector={}))
    kube.create(POOLS, None, pool("llama", servedModels=["chat"]))
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    kube.create(ENTITLEMENTS, TEAM_B, ent("blue", "guaranteed", 2))
    bench.settle()
    assert bench.states() == {"gold": "Bound"} and bench.states(TEAM_B) == {"blue": "Bound"}
    lookup = CachedLookup(kube).start()
    try:
        wait_until(
            lambda: (
                len(lookup.entitlements()) == 2
                and all(
                    (e.get("status") or {}).get("state") == "Bound" for e in lookup.entitlements()
                )
                and len(lookup.pools()) == 2
            )
        )
        yield lookup
    finally:
        lookup.stop()


def test_an_update_names_only_what_the_old_spec_admitted(two_tenants: CachedLookup) -> None:
    """blue is still Bound (its grace), but the pool already missed team-b before this edit:
    closing the pool is this edit's doing for gold only."""
    old = pool(namespaceSelector={"matchLabels": TENANT_LABEL}, servedModels=["qwen", "chat"])
    new = pool(namespaceSelector=CLOSED, servedModels=["qwen", "chat"])
    why = _answer(two_tenants, _edit(old, new))
    assert why is not None and "would unbind 1 Bound entitlements" in why
    assert "tenants/gold" in why and TEAM_B not in why
    # widening it takes no one's binding
    assert _answer(two_tenants, _edit(old, pool(namespaceSelector={}))) is None


def test_an_update_that_leaves_selector_and_models_alone_is_allowed(
    two_tenants: CachedLookup,
) -> None:
    """The state it finds (blue Bound outside the selector, "chat" served by llama and by this
    pool, as before an upgrade or with the webhook away) is no reason to refuse an annotation
    change or a finalizer patch."""
    old = pool(namespaceSelector={"matchLabels": TENANT_LABEL}, servedModels=["qwen", "chat"])
    for new in (
        _annotated(old, note="hello"),
        {**old, "metadata": {**old["metadata"], "finalizers": ["tokenpools.io/cleanup"]}},
        {**old, "spec": {**old["spec"], "replicas": 3}},
    ):
        assert _answer(two_tenants, _edit(old, new)) is None
    # a model name the edit adds is still checked
    narrow = pool(namespaceSelector={"matchLabels": TENANT_LABEL}, servedModels=["qwen"])
    why = _answer(two_tenants, _edit(narrow, old))
    assert why is not None and "'chat' is already served by TokenPool 'llama'" in why
    # and a create is judged whole
    assert "'chat'" in (_answer(two_tenants, _review("TokenPool", old, "CREATE")) or "")


def test_only_an_acknowledgement_made_in_the_same_edit_counts(two_tenants: CachedLookup) -> None:
    old = pool(namespaceSelector={}, servedModels=["qwen", "chat"])
    closed = pool(namespaceSelector=CLOSED, servedModels=["qwen", "chat"])
    both = "tenants/gold, team-b/blue"
    # a "*" left on the pool by an earlier edit approves nothing later
    stale = _answer(two_tenants, _edit(_annotated(old, **{ACKNOWLEDGE: "*"}),
                                       _annotated(closed, **{ACKNOWLEDGE: "*"})))  # fmt: skip
    assert stale is not None and "team-b/blue, tenants/gold" in stale
    # added, or changed, in this request: it counts
    assert _answer(two_tenants, _edit(old, _annotated(closed, **{ACKNOWLEDGE: "*"}))) is None
    changed = _edit(_annotated(old, **{ACKNOWLEDGE: "tenants/gold"}),
                    _annotated(closed, **{ACKNOWLEDGE: both}))  # fmt: skip
    assert _answer(two_tenants, changed) is None
    # changed, but not naming everyone it unbinds
    partly = _edit(_annotated(old, **{ACKNOWLEDGE: "*"}),
                   _annotated(closed, **{ACKNOWLEDGE: "tenants/gold"}))  # fmt: skip
    assert "team-b/blue" in (_answer(two_tenants, partly) or "")
