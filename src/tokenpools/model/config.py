"""The configuration: one YAML document, validated against model/config_schema.py with
errors that name the field, into the frozen `Config` the rest of the code sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tokenpools.model.budgets import Budget, UsageSettings
from tokenpools.model.config_schema import ConfigSpec
from tokenpools.model.entitlement import BindingState, Entitlement
from tokenpools.model.identity import JwtSettings, Tenant, TrustedHeaderSettings
from tokenpools.model.policy import Policy
from tokenpools.model.pool import Pool


class ConfigError(ValueError):
    """An invalid configuration; the message lists every problem, one per line."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    admin_key_hashes: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    chars_per_token: float = 4.0
    max_sequences: int = 8  # the most sequences (`n`, `best_of`) one request may ask for
    tokenize_timeout_s: float = 0.5  # a pool's `tokenizer: backend` waits this long, then estimates
    jwt: JwtSettings | None = None
    trusted_header: TrustedHeaderSettings | None = None


@dataclass(frozen=True, slots=True)
class StateSettings:
    backend: str = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tokenpools"
    timeout_s: float = 0.25  # one call to Redis waits at most this long (docs/redis.md)
    retry_interval_s: float = 0.25  # once Redis is judged unreachable, it is tried again after this
    fallback_fraction: float = 0.5  # of a protected baseline, per replica, while Redis is away
    replica_timeout_s: float = 10.0  # a replica that has not ticked for this long is gone


@dataclass(frozen=True, slots=True)
class Config:
    policy: Policy
    pools: dict[str, Pool]
    entitlements: dict[str, Entitlement]
    gateway: GatewaySettings = GatewaySettings()
    state: StateSettings = StateSettings()
    # Tenants named in `tenants` with their keys; a tenant named only by its entitlements'
    # tenantId has no entry (and no keys but those written on its entitlements).
    tenants: dict[str, Tenant] = field(default_factory=dict)
    budgets: dict[str, Budget] = field(default_factory=dict)  # by name
    usage: UsageSettings = field(default_factory=UsageSettings)
    # Binding decided outside the core (kube-scheduler, read from the operator's status);
    # None: the core binds (file mode, simulator).
    bindings: dict[str, BindingState] | None = None


def parse_config(data: Any) -> Config:
    """Validate a parsed YAML/JSON document; raise ConfigError naming each bad field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    try:
        spec = ConfigSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc)) from None
    pools = {p.name: p.to_pool() for p in spec.pools}
    entitlements = {e.name: e.to_entitlement(pools[e.pool]) for e in spec.entitlements}
    g, st = spec.gateway, spec.state
    return Config(
        policy=spec.policy.to_policy(),
        pools=pools,
        entitlements=entitlements,
        tenants={t.id: t.to_tenant() for t in spec.tenants},
        budgets={b.name: b.to_budget() for b in spec.budgets},
        usage=_usage(spec),
        gateway=GatewaySettings(
            tuple(g.adminKeys),
            g.maxBodyBytes,
            g.charsPerToken,
            g.maxSequences,
            g.tokenizeTimeoutMs / 1000,
            None if g.jwt is None else g.jwt.to_settings(),
            None if g.trustedHeader is None else g.trustedHeader.to_settings(),
        ),
        state=StateSettings(
            backend=st.backend,
            url=st.url,
            key_prefix=st.keyPrefix,
            timeout_s=st.timeoutMs / 1000,
            retry_interval_s=st.retryIntervalS,
            fallback_fraction=st.fallbackFraction,
            replica_timeout_s=st.replicaTimeoutS,
        ),
    )


def _usage(spec: ConfigSpec) -> UsageSettings:
    try:  # the webhook secret is read from the environment here
        return spec.usage.to_settings()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        config = parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: invalid config\n{exc}") from None
    # the default ledger is this file's own (model/budgets.py default_database)
    return replace(config, usage=replace(config.usage, origin=str(path.resolve())))


def format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        where = _location(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("value_error", "assertion_error") or err["type"] == "missing":
            lines.append(f"{where}: {msg}" if where else msg)
        else:
            lines.append(f"{where}: {msg} (got {err['input']!r})")
    return "\n".join(lines)


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "ProfileSpec", "function-after[_check(), ProfileSpec]"):
            continue  # pydantic's union-branch labels say nothing to a user
        else:
            out += f".{part}" if out else str(part)
    return out
