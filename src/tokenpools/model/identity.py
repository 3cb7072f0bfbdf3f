"""Who calls: tenants, their API keys, and how a gateway may learn a tenant other than by a
key (a JWT from an identity provider, a header set by a trusted auth proxy)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ApiKey:
    hash: str  # sha256 of the key (model/keys.py); the key itself is never stored
    tenant: str
    label: str  # shown in logs and metrics instead of the key
    expires_at: float | None = None  # epoch seconds
    models: frozenset[str] | None = None  # narrower than the tenant's; None: all of them
    # A key written on an entitlement (the shape before tenants): it reaches that one only.
    entitlement: str | None = None


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    keys: tuple[ApiKey, ...] = ()


@dataclass(frozen=True, slots=True)
class JwtSettings:
    """Bearer JWTs from an identity provider: verified against its public keys (a JWKS)."""

    issuer: str
    audience: tuple[str, ...]
    algorithms: tuple[str, ...]  # asymmetric only: never `none`, never an HMAC
    jwks_url: str | None = None
    jwks_file: str | None = None
    leeway_s: float = 30.0
    tenant_claim: str = "tenant"
    models_claim: str | None = None  # a list (or space-separated string) narrowing the models
    refresh_min_interval_s: float = 30.0  # an unknown kid refetches the JWKS at most this often
    cache_ttl_s: float = 3600.0  # known keys are refetched in the background after this
    timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class TrustedHeaderSettings:
    """The tenant named by a header that an auth proxy in front sets: honoured only from the
    proxy's addresses, or with the proxy's shared secret."""

    name: str
    from_cidrs: tuple[str, ...] = ()
    secret_header: str | None = None
    secret_hash: str | None = None  # sha256 of the shared secret
