"""Who a request is: the tenant named by a trusted auth proxy's header, or by the bearer
credential — an API key (looked up by its hash) or a JWT from the configured identity
provider. Each refusal is a 401 (or a 403 for a tenant with nothing here) naming the problem.

A trusted header from anywhere but the proxy (its addresses, or its shared secret) is ignored:
the request is judged by its other credentials, and a 401 says why the header did not count.
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokenpools.control.tenancy import Caller, Directory, Refused
from tokenpools.identity.jwt import JwtVerifier, TokenRefused, looks_like_jwt
from tokenpools.model.config import GatewaySettings
from tokenpools.model.keys import hash_key


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a request shows of who it is, whichever host received it: its headers (names
    matched without regard to case, as HTTP's are) and the peer's address."""

    headers: Mapping[str, str]  # matched without regard to case (e.g. multidict.CIMultiDict)
    remote: str | None = None  # the peer's IP address; None: unknown (a Unix socket)


def bearer(headers: Mapping[str, str]) -> str | None:
    """The bearer credential of an Authorization header."""
    header = headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


class Authenticator:
    def __init__(self, settings: GatewaySettings, clock: Callable[[], float] = time.time) -> None:
        self.settings, self.clock = settings, clock
        self.jwt = None if settings.jwt is None else JwtVerifier(settings.jwt, clock)
        trusted = settings.trusted_header
        self._networks = [
            ipaddress.ip_network(c, strict=False) for c in (trusted.from_cidrs if trusted else ())
        ]

    def adopt(self, settings: GatewaySettings) -> Authenticator:
        """The authenticator for new settings; the JWKS cache is kept when `jwt` is unchanged."""
        fresh = Authenticator(settings, self.clock)
        if self.jwt is not None and settings.jwt == self.settings.jwt:
            fresh.jwt = self.jwt
        return fresh

    async def caller(self, shown: Credentials, directory: Directory) -> Caller | Refused:
        trusted, ignored = self.settings.trusted_header, ""
        headers = shown.headers
        if trusted is not None and trusted.name in headers:
            if self._trusts(shown):
                return directory.known(Caller(headers[trusted.name], "header"))
            ignored = f" (header {trusted.name} is honoured only from the auth proxy)"
        token = bearer(headers)
        if token is None:
            return Refused("invalid_api_key", "no API key or token" + ignored)
        keyed = directory.by_key(token, self.clock())
        if keyed is not None:
            return keyed
        if self.jwt is not None and looks_like_jwt(token):
            try:
                claims = await self.jwt.verify(token)
            except TokenRefused as exc:
                return Refused("invalid_token", str(exc))
            return directory.known(
                Caller(claims.tenant, "jwt", claims.models, subject=claims.subject)
            )
        return Refused("invalid_api_key", "invalid API key" + ignored)

    def _trusts(self, shown: Credentials) -> bool:
        trusted = self.settings.trusted_header
        assert trusted is not None
        if trusted.secret_header is not None and trusted.secret_hash is not None:
            secret = shown.headers.get(trusted.secret_header)
            if secret is not None and hmac.compare_digest(hash_key(secret), trusted.secret_hash):
                return True
        if not self._networks or shown.remote is None:
            return False
        try:
            peer = ipaddress.ip_address(shown.remote)
        except ValueError:  # a Unix socket: no address to trust
            return False
        return any(peer in net for net in self._networks)
