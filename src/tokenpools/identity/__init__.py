"""Who a request is, for any host: an `Authenticator` judges the `Credentials` a request shows
(its headers and peer) — a trusted auth proxy's header, an API key, or a JWT verified against
the identity provider's keys (jwt.py) — and names its tenant, or the refusal. No server
library: the gateway hands in aiohttp's headers, other hosts their own (jwt.py fetches the
provider's keys with aiohttp's client)."""

from tokenpools.identity.authenticator import Authenticator, Credentials, bearer
from tokenpools.identity.jwt import JwtVerifier, TokenRefused, looks_like_jwt

__all__ = [
    "Authenticator",
    "Credentials",
    "JwtVerifier",
    "TokenRefused",
    "bearer",
    "looks_like_jwt",
]
