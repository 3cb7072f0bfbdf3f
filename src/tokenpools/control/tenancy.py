"""The tenant directory: who a credential is, which models a caller may use, and which of its
tenant's entitlements (its layers, control/layers.py) a request for a model is tried against.

A request's credential resolves to a tenant (a key here; a JWT or a trusted header in
identity/authenticator.py, which asks `known` of the tenant they name); its `model` resolves to
the pool that serves it; the tenant's entitlements in that pool decide, in layer order. Pure:
the host passes the time a key's expiry is judged by.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenpools.model.config import Config
from tokenpools.model.entitlement import Entitlement
from tokenpools.model.identity import ApiKey
from tokenpools.model.keys import hash_key
from tokenpools.model.service_class import ServiceClass

LAYER_ORDER: tuple[ServiceClass, ...] = tuple(ServiceClass)  # dedicated first, preemptible last


def layer_key(ent: Entitlement) -> tuple[int, str]:
    return LAYER_ORDER.index(ent.service_class), ent.name


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller: its tenant, and what narrows the tenant's reach."""

    tenant: str
    credential: str  # as metrics name it (bounded): a key's label, `jwt`, or `header`
    models: frozenset[str] | None = None  # None: every model of the tenant
    entitlement: str | None = None  # a key written on an entitlement reaches that one only
    subject: str | None = None  # a JWT's `sub`, for the access log


@dataclass(frozen=True, slots=True)
class Refused:
    """A credential refused; hosts answer 401, or 403 when `forbidden` (a caller who is who it
    says, of a tenant with nothing here)."""

    code: str  # the OpenAI error's code, and the unauthorized metric's reason
    message: str
    forbidden: bool = False


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    entitlements: tuple[str, ...]  # the tenant's in that pool, in layer order


class Directory:
    def __init__(self, config: Config) -> None:
        self._model_pool = {m: p.name for p in config.pools.values() for m in p.models}
        self._pool_models = {p.name: p.models for p in config.pools.values()}
        layers: dict[tuple[str, str], list[Entitlement]] = {}
        for ent in config.entitlements.values():
            layers.setdefault((ent.tenant_id, ent.pool), []).append(ent)
        self._layers = {
            at: tuple(e.name for e in sorted(ents, key=layer_key)) for at, ents in layers.items()
        }
        self._ent_pool = {e.name: (e.tenant_id, e.pool) for e in config.entitlements.values()}
        self.tenants = frozenset(config.tenants) | {t for t, _ in self._layers}
        self._keys: dict[str, ApiKey] = {
            k.hash: k for tenant in config.tenants.values() for k in tenant.keys
        }
        for ent in config.entitlements.values():  # the shape before tenants: one entitlement
            for h in ent.api_key_hashes:
                self._keys[h] = ApiKey(h, ent.tenant_id, ent.name, entitlement=ent.name)

    def by_key(self, presented: str, now: float) -> Caller | Refused | None:
        """The caller a presented key makes, or its refusal (expired); None: no key known
        here (the host may try its other credentials)."""
        key = self._keys.get(hash_key(presented))
        if key is None:
            return None
        if key.expires_at is not None and now >= key.expires_at:
            return Refused("expired_api_key", f"API key {key.label!r} has expired")
        return Caller(key.tenant, key.label, key.models, key.entitlement)

    def known(self, caller: Caller) -> Caller | Refused:
        """A caller named by a token or a header: its tenant must hold something here."""
        if caller.tenant in self.tenants:
            return caller
        return Refused("unknown_tenant", "the caller's tenant has no entitlements here", True)

    def route(self, caller: Caller, model: object) -> Route | None:
        """Where a request for `model` goes, if the caller may use it: None is a 404 (a model
        a caller cannot use is one it cannot see)."""
        pool = self._model_pool.get(model) if isinstance(model, str) else None
        if pool is None or (caller.models is not None and model not in caller.models):
            return None
        if caller.entitlement is not None:
            if self._ent_pool.get(caller.entitlement) != (caller.tenant, pool):
                return None
            return Route(pool, (caller.entitlement,))
        layers = self._layers.get((caller.tenant, pool))
        return None if layers is None else Route(pool, layers)

    def models(self, caller: Caller) -> list[str]:
        """The models the caller may use, sorted (what /v1/models lists)."""
        if caller.entitlement is not None:  # that one entitlement's pool, if it is still there
            at = self._ent_pool.get(caller.entitlement)
            pools = [at[1]] if at is not None and at[0] == caller.tenant else []
        else:
            pools = [pool for tenant, pool in self._layers if tenant == caller.tenant]
        found = {m for pool in pools for m in self._pool_models[pool]}
        if caller.models is not None:
            found &= caller.models
        return sorted(found)

    def layers(self, tenant: str) -> dict[str, tuple[str, ...]]:
        """A tenant's entitlements by pool, in layer order."""
        return {pool: names for (t, pool), names in self._layers.items() if t == tenant}
