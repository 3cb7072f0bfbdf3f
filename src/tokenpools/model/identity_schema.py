"""The config file's identity sections (pydantic): `tenants` with their keys, and the gateway's
`jwt` and `trustedHeader` settings."""

from __future__ import annotations

import ipaddress
from datetime import datetime
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from tokenpools.model.identity import ApiKey, JwtSettings, Tenant, TrustedHeaderSettings
from tokenpools.model.keys import is_key_hash
from tokenpools.model.schema_base import NonNeg, Pos, Strict

# Verified with the issuer's public keys only: `none` and the HMACs (HS*) are refused, so a
# token signed with a public key as an HMAC secret can never pass.
ALGORITHMS = (
    *("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"),
)
HEADER_NAME = r"^[A-Za-z0-9-]{1,64}$"
_HASH_HELP = "a sha256 hash ('sha256:' + 64 hex digits; make one with `tokenpools hash-key`)"


class KeySpec(Strict):
    hash: str
    label: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[\w.:@/-]+$")] | None = None
    expiresAt: datetime | None = None
    models: list[Annotated[str, Field(min_length=1)]] | None = None

    @field_validator("hash")
    @classmethod
    def _hashed(cls, value: str) -> str:
        if not is_key_hash(value):
            raise ValueError(f"expected {_HASH_HELP}, got {value[:12]!r}...")
        return value

    def to_key(self, tenant: str) -> ApiKey:
        return ApiKey(
            self.hash,
            tenant,
            self.label or "key-" + self.hash[7:15],
            None if self.expiresAt is None else self.expiresAt.timestamp(),
            None if self.models is None else frozenset(self.models),
        )


class TenantSpec(Strict):
    id: Annotated[str, Field(min_length=1)]  # an entitlement's tenantId
    keys: list[KeySpec] = []

    def to_tenant(self) -> Tenant:
        return Tenant(self.id, tuple(k.to_key(self.id) for k in self.keys))


class JwtSpec(Strict):
    issuer: Annotated[str, Field(min_length=1)]
    audience: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]]
    algorithms: list[str] = ["RS256", "ES256"]
    jwksUrl: Annotated[str, Field(pattern=r"^https?://[^/\s]+(/\S*)?$")] | None = None
    jwksFile: Annotated[str, Field(min_length=1)] | None = None
    leewayS: Annotated[float, Field(ge=0, le=300)] = 30.0
    tenantClaim: Annotated[str, Field(min_length=1)] = "tenant"
    modelsClaim: Annotated[str, Field(min_length=1)] | None = None
    refreshMinIntervalS: NonNeg = 30.0
    cacheTtlS: Pos = 3600.0
    timeoutMs: Annotated[float, Field(gt=0, le=30000)] = 2000.0

    @field_validator("algorithms")
    @classmethod
    def _asymmetric(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one algorithm")
        for alg in value:
            if alg not in ALGORITHMS:
                raise ValueError(
                    f"algorithm {alg!r} is not allowed: tokens are verified with the issuer's "
                    f"public keys only ({', '.join(ALGORITHMS)})"
                )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> JwtSpec:
        if (self.jwksUrl is None) == (self.jwksFile is None):
            raise ValueError("give jwksUrl or jwksFile (one of them)")
        return self

    def to_settings(self) -> JwtSettings:
        audience = [self.audience] if isinstance(self.audience, str) else self.audience
        return JwtSettings(
            issuer=self.issuer,
            audience=tuple(audience),
            algorithms=tuple(self.algorithms),
            jwks_url=self.jwksUrl,
            jwks_file=self.jwksFile,
            leeway_s=self.leewayS,
            tenant_claim=self.tenantClaim,
            models_claim=self.modelsClaim,
            refresh_min_interval_s=self.refreshMinIntervalS,
            cache_ttl_s=self.cacheTtlS,
            timeout_s=self.timeoutMs / 1000,
        )


class TrustedHeaderSpec(Strict):
    name: Annotated[str, Field(pattern=HEADER_NAME)] = "x-tokenpools-tenant"
    fromCidrs: list[str] = []
    secretHeader: Annotated[str, Field(pattern=HEADER_NAME)] | None = None
    secretHash: str | None = None

    @field_validator("fromCidrs")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an IP network (e.g. 10.0.0.0/8)") from None
        return value

    @model_validator(mode="after")
    def _trust(self) -> TrustedHeaderSpec:
        if (self.secretHeader is None) != (self.secretHash is None):
            raise ValueError("give secretHeader and secretHash together")
        if self.secretHash is not None and not is_key_hash(self.secretHash):
            raise ValueError(f"secretHash: expected {_HASH_HELP}")
        if not self.fromCidrs and self.secretHeader is None:
            raise ValueError(
                "say whom to trust: fromCidrs (the auth proxy's addresses) and/or "
                "secretHeader with secretHash"
            )
        return self

    def to_settings(self) -> TrustedHeaderSettings:
        return TrustedHeaderSettings(
            self.name.lower(),
            tuple(self.fromCidrs),
            None if self.secretHeader is None else self.secretHeader.lower(),
            self.secretHash,
        )
