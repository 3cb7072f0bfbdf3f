"""TokenBudgets ↔ the config's budgets. A TokenBudget is cluster-scoped and the platform's
(no tenant may raise its own budget): its spec is a `budgets[]` entry without `name`; a
tenant is a namespace, an entitlement `<namespace>/<name>`. The budgets of the gateway's own
config file join them. A budget naming a tenant, entitlement or key the cluster does not have
(yet) is set aside with its problem — it never makes the cluster's whole config invalid — and
applies once its target exists."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from tokenpools.k8s.applied import ClusterConfig, Where, age, in_force, live, no_replaced
from tokenpools.k8s.names import entitlement_key
from tokenpools.k8s.schema import API_VERSION, BUDGET_REPLACED, BudgetExtras
from tokenpools.model.budgets_schema import BudgetSpec
from tokenpools.model.identity_schema import TenantSpec

_DNS_SUBDOMAIN = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


def check_budget(spec: Mapping[str, Any], where: Where) -> tuple[dict[str, Any], None]:
    no_replaced(spec, BUDGET_REPLACED, BudgetExtras)
    out = {**spec, "name": where[2]}
    BudgetSpec.model_validate(out)
    return out, None


def add_budgets(
    out: ClusterConfig, objects: Sequence[Mapping[str, Any]], applied_only: bool
) -> None:
    """The TokenBudgets in force joined to the config file's budgets (a file's budget keeps
    its name), then only those whose target the cluster has."""
    given = out.data.get("budgets")
    budgets = list(given) if isinstance(given, list) else []
    named = {b.get("name") for b in budgets if isinstance(b, Mapping)}
    origins: list[Where] = [("Budget", "", str(b.get("name"))) for b in budgets]
    for obj in sorted(live(list(objects)), key=age):
        where = ("TokenBudget", "", obj["metadata"]["name"])
        got = in_force(obj, where, check_budget, applied_only, out)
        if got is None:
            continue
        if where[2] in named:
            out.problems[where] = f"a budget named {where[2]!r} is in the gateway's config"
            del out.applied[where]
            continue
        budgets.append(got[0])
        origins.append(where)
    if budgets or given is not None:
        out.data["budgets"] = _with_targets(out, budgets, origins)


def _with_targets(out: ClusterConfig, budgets: list[Any], origins: list[Where]) -> list[Any]:
    ents = {e["name"]: e["tenantId"] for e in out.data["entitlements"]}
    keys = {f"{e['tenantId']}/{e['name']}" for e in out.data["entitlements"] if e["apiKeys"]}
    tenants = set(ents.values())
    for t in out.data.get("tenants") or []:
        with contextlib.suppress(ValidationError, TypeError):  # the schema names the problem
            one = TenantSpec.model_validate(t).to_tenant()
            tenants.add(one.id)
            keys |= {f"{one.id}/{k.label}" for k in one.keys}
    kept = []
    for budget, where in zip(budgets, origins, strict=True):
        if not isinstance(budget, Mapping):
            kept.append(budget)  # the schema names the problem
            continue
        tenant, ent, key = budget.get("tenant"), budget.get("entitlement"), budget.get("key")
        missing = (
            (tenant is not None and tenant not in tenants)
            or (ent is not None and ent not in ents)
            or (key is not None and key not in keys)
        )
        if missing:
            out.problems[where] = "its tenant, entitlement or key is not in the cluster (yet)"
            out.applied.pop(where, None)
        else:
            kept.append(budget)
    return kept


def budget_objects(
    budgets: Sequence[Mapping[str, Any]], ents: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """A config file's budgets as TokenBudgets (`tokenpools k8s render`)."""
    tenant_of = {e["name"]: e["tenantId"] for e in ents}
    objects = []
    for budget in budgets:
        if not _DNS_SUBDOMAIN.match(budget["name"]):
            raise ValueError(
                f"budget {budget['name']!r} is not a valid object name (lower-case letters, "
                "digits, '-' and '.', at most 253)"
            )
        spec = {k: v for k, v in budget.items() if k != "name"}
        if "entitlement" in spec:  # in a cluster an entitlement is <namespace>/<name>
            ent = spec["entitlement"]
            spec["entitlement"] = entitlement_key(tenant_of[ent], ent)
        meta = {"name": budget["name"]}
        objects.append({"apiVersion": API_VERSION, "kind": "TokenBudget", "metadata": meta,
                        "spec": spec})  # fmt: skip
    return objects
