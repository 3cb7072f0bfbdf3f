"""The cluster as the gateway's config source (`tokenpools serve --kubernetes`).

Pools, entitlements and the key Secrets of one namespace become one Config, validated as a
file is; each entitlement's binding is the state the operator wrote from its lease pod, so the
gateway honours kube-scheduler's decision (an entitlement without one is Pending)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tokenpools.k8s.api import ENTITLEMENTS, POOLS, SECRETS, Kube
from tokenpools.k8s.resources import config_data
from tokenpools.model.config import Config, parse_config
from tokenpools.model.entitlement import BindingState

_STATES = {s.value: s for s in BindingState}


def read_cluster(
    kube: Kube, namespace: str
) -> tuple[list[Any], list[Any], dict[tuple[str, str], Any]]:
    pools = kube.list(POOLS, namespace)
    ents = kube.list(ENTITLEMENTS, namespace)
    secrets = {
        (namespace, s["metadata"]["name"]): s.get("data") or {}
        for s in kube.list(SECRETS, namespace)
    }
    return pools, ents, secrets


def cluster_config(
    pools: list[Any],
    ents: list[Any],
    secrets: Mapping[tuple[str, str], Any],
    base: Mapping[str, Any] | None = None,
) -> Config:
    """Raises ConfigError when the objects together are invalid (e.g. a key used twice);
    objects invalid alone are left out, as the operator reports them Invalid."""
    cluster = config_data(pools, ents, secrets, base)
    config = parse_config(cluster.data)
    bindings = {
        e["metadata"]["name"]: _STATES.get(
            (e.get("status") or {}).get("state", ""), BindingState.PENDING
        )
        for e in ents
    }
    return replace(config, bindings=bindings)
