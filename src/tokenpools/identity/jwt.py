"""Bearer JWTs from an identity provider, verified with PyJWT against the provider's public keys
(a JWKS from a URL or a file).

Keys are cached by `kid`. A token whose key is cached never waits on the provider: a JWKS that
has grown stale is fetched again in the background. An unknown `kid` fetches it at once (a
rotated key), but at most once per `refresh_min_interval_s`, and concurrent requests share one
fetch, so a storm of forged kids cannot hammer the provider. The time a token is judged by is
the gateway's clock (injected), not PyJWT's.

A verified token is remembered (up to `VERIFIED_CACHE` of them) until its `exp`, so a client
that sends the same token with each request pays for one signature check, not one per request;
a new key set (a rotation) forgets them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import aiohttp
import jwt

from tokenpools.model.identity import JwtSettings

log = logging.getLogger("tokenpools.gateway")
VERIFIED_CACHE = 4096


class TokenRefused(Exception):
    """Why a token is refused; the message is the 401's."""


@dataclass(frozen=True, slots=True)
class Claims:
    tenant: str
    subject: str | None
    models: frozenset[str] | None


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


class JwtVerifier:
    def __init__(self, settings: JwtSettings, clock: Callable[[], float] = time.time) -> None:
        self.settings, self.clock = settings, clock
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._fetched_at = -float("inf")  # when the keys in hand were read
        self._tried_at = -float("inf")  # when a fetch was last started
        self._fetching: asyncio.Task[None] | None = None
        self._verified: OrderedDict[str, tuple[Claims, float, float | None]] = OrderedDict()
        if settings.jwks_file is not None:
            self._adopt(_read_file(settings.jwks_file))

    async def verify(self, token: str) -> Claims:
        """The token's claims, or TokenRefused naming why not. The one boundary for tokens:
        whatever the JWT library (or anything under it) raises for a token a client sent is a
        refusal, never an error of the gateway's."""
        known = self._verified.get(token)
        if known is not None:  # verified before (its claims checked then): only time moved
            verified, exp, nbf = known
            self._check_times({"exp": exp, "nbf": nbf})
            self._verified.move_to_end(token)
            self._refresh_if_stale()
            return verified
        try:
            return await self._verify(token)
        except TokenRefused:
            raise
        except Exception as exc:  # a token this code or the library did not foresee
            log.debug("token refused", exc_info=True)
            raise TokenRefused(f"invalid token ({type(exc).__name__})") from None

    async def _verify(self, token: str) -> Claims:
        s = self.settings
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            raise TokenRefused("malformed token: not a JWT") from None
        except jwt.InvalidTokenError as exc:  # a header field of the wrong type, say
            raise TokenRefused(f"malformed token header: {exc}") from None
        alg = _checked_header(header, s.algorithms)
        kid = header.get("kid")
        key = await self._key(kid)
        if not _fits(alg, key):
            raise TokenRefused(f"token algorithm {alg} does not fit key {kid!r} ({key.key_type})")
        try:
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=list(s.audience),
                issuer=s.issuer,
                options={"verify_exp": False, "verify_nbf": False, "verify_iat": False},
            )
        except jwt.InvalidSignatureError:
            raise TokenRefused("bad token signature") from None
        except jwt.InvalidAudienceError:
            raise TokenRefused(f"wrong token audience (expected {', '.join(s.audience)})") from None
        except jwt.InvalidIssuerError:
            raise TokenRefused(f"wrong token issuer (expected {s.issuer})") from None
        except jwt.MissingRequiredClaimError as exc:
            raise TokenRefused(f"the token has no {exc.claim!r} claim") from None
        except (jwt.InvalidTokenError, jwt.PyJWKError) as exc:
            raise TokenRefused(f"invalid token: {exc}") from None
        self._check_times(claims)
        verified = self._claims(claims)
        self._verified[token] = (verified, claims["exp"], claims.get("nbf"))
        if len(self._verified) > VERIFIED_CACHE:
            self._verified.popitem(last=False)
        return verified

    def _check_times(self, claims: dict[str, Any]) -> None:
        now, leeway = self.clock(), self.settings.leeway_s
        exp, nbf, iat = claims.get("exp"), claims.get("nbf"), claims.get("iat")
        if not _is_time(exp):
            raise TokenRefused("the token has no 'exp' claim that is a finite number")
        if now > exp + leeway:
            raise TokenRefused("token expired")
        if nbf is not None and (not _is_time(nbf) or now < nbf - leeway):
            raise TokenRefused("token not yet valid (nbf)")
        if iat is not None and not _is_time(iat):
            raise TokenRefused("the token's 'iat' claim is not a finite number")

    def _claims(self, claims: dict[str, Any]) -> Claims:
        s = self.settings
        tenant = claims.get(s.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise TokenRefused(f"the token has no {s.tenant_claim!r} claim naming a tenant")
        models: frozenset[str] | None = None
        if s.models_claim is not None and s.models_claim in claims:
            value = claims[s.models_claim]
            if isinstance(value, str):
                value = value.split()
            if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
                raise TokenRefused(f"the token's {s.models_claim!r} claim is not a list of models")
            models = frozenset(value)
        subject = claims.get("sub")
        return Claims(tenant, subject if isinstance(subject, str) else None, models)

    # -- keys ----------------------------------------------------------------------------

    async def _key(self, kid: object) -> jwt.PyJWK:
        now = self.clock()
        assert kid is None or isinstance(kid, str)  # _checked_header made sure
        key = self._pick(kid)
        if key is not None:
            self._refresh_if_stale()
            return key
        if now - self._tried_at >= self.settings.refresh_min_interval_s:
            self._start_fetch(now)
        if self._fetching is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._fetching)
        key = self._pick(kid)
        if key is None:
            raise TokenRefused(f"unknown token key id (kid {kid!r})")
        return key

    def _refresh_if_stale(self) -> None:
        now = self.clock()
        if now - self._fetched_at > self.settings.cache_ttl_s:
            self._start_fetch(now)  # in the background: the token in hand goes on

    def _pick(self, kid: str | None) -> jwt.PyJWK | None:
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        return self._keys.get(kid)

    def _start_fetch(self, now: float) -> None:
        if self._fetching is not None and not self._fetching.done():
            return
        self._tried_at = now
        self._fetching = asyncio.get_running_loop().create_task(self._fetch())

    async def _fetch(self) -> None:
        s = self.settings
        try:
            if s.jwks_file is not None:
                data = await asyncio.to_thread(_read_file, s.jwks_file)
            else:
                assert s.jwks_url is not None
                data = await _download(s.jwks_url, s.timeout_s)
            self._adopt(data)
        except Exception as exc:  # the keys in hand stay; the next unknown kid tries again
            log.warning("JWKS from %s: %s", s.jwks_url or s.jwks_file, exc)

    def _adopt(self, data: Any) -> None:
        keys = jwt.PyJWKSet.from_dict(data).keys  # unusable keys are skipped
        fresh = {k.key_id: k for k in keys}
        if set(fresh) != set(self._keys) or any(
            fresh[kid].key != self._keys[kid].key for kid in fresh
        ):
            self._verified.clear()  # a withdrawn key's tokens are checked again, and refused
        self._keys = fresh
        self._fetched_at = self.clock()


async def _download(url: str, timeout_s: float) -> Any:
    # A session of its own: nothing of the gateway's (backend keys) ever goes to the provider.
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession() as session, session.get(url, timeout=timeout) as r:
        r.raise_for_status()
        return json.loads(await r.read())


def _read_file(path: str) -> Any:
    return json.loads(Path(path).read_text())


def _is_time(value: object) -> TypeGuard[float]:
    """A JSON number that is a moment: not a bool, not NaN or infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _checked_header(header: object, algorithms: Sequence[str]) -> str:
    """The token's algorithm, once its header is one this verifier can use: an object, an
    allowed `alg`, a string `kid` (or none), and no `crit` extension (none is understood, and
    RFC 7515 says a token naming one that is not must be refused)."""
    if not isinstance(header, dict):
        raise TokenRefused("malformed token: its header is not a JSON object")
    alg = header.get("alg")
    if not isinstance(alg, str) or alg not in algorithms:
        shown = (
            repr(alg)
            if isinstance(alg, str) and len(alg) <= 16
            else f"of type {type(alg).__name__}"
        )
        raise TokenRefused(f"token algorithm {shown} is not allowed ({', '.join(algorithms)})")
    kid = header.get("kid")
    if kid is not None and (not isinstance(kid, str) or len(kid) > 256):
        raise TokenRefused("the token's key id (kid) is not a string")
    if "crit" in header:
        raise TokenRefused("the token names critical header extensions (crit): none is supported")
    return alg


# The key type (JWK `kty`) each algorithm family signs with.
_FAMILY = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP", "HS": "oct"}


def _fits(alg: str, key: jwt.PyJWK) -> bool:
    """Whether a token's algorithm can be checked with this key at all (an ES256 token against
    an RSA key, or HS256 against a public key, cannot)."""
    return _FAMILY.get(alg[:2]) == key.key_type
