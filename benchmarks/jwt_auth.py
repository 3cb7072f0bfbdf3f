"""What a JWT costs a request: the gateway's authentication of one request
(identity/authenticator.py), by an API key (a hash lookup) and by a bearer JWT whose key is
cached (RS256 and ES256, PyJWT and cryptography): the same token on every request (verified
once, then remembered) and a new token on each (a signature check each). CPU per request in-
process, the median of several runs. Prints and writes JSON.

    .venv-pure/bin/python benchmarks/jwt_auth.py --json out/jwt_auth.json
    .venv-pure/bin/python benchmarks/jwt_auth.py --json /tmp/jwt_auth.json --smoke  # the tests'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jwt
from aiohttp.test_utils import make_mocked_request
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from smoke import parse_args
from tokenpools.control.tenancy import Caller, Directory
from tokenpools.identity import Authenticator, Credentials
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key

ISSUER, AUDIENCE = "https://idp.example.test", "tokenpools"
# The JSON (paths as in benchmarks/smoke.py): per credential, µs per request.
FIELDS = (
    "API key.median_us", "API key.min_us", "API key.max_us",
    "JWT RS256, the same token each request.median_us",
    "JWT RS256, a new token each request.median_us",
    "JWT ES256, the same token each request.median_us",
    "JWT ES256, a new token each request.median_us",
    "*.median_us", "*.min_us", "*.max_us",
)  # fmt: skip
SMOKE = {"requests": 20, "repeats": 1}


def keys() -> dict[str, Any]:
    return {
        "RS256": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "ES256": ec.generate_private_key(ec.SECP256R1()),
    }


def config(jwks_file: Path) -> dict[str, Any]:
    return {
        "gateway": {"jwt": {"issuer": ISSUER, "audience": AUDIENCE, "jwksFile": str(jwks_file)}},
        "pools": [{"name": "p", "model": "Qwen3-8B", "perReplica": {
            "tokensPerSecond": 1000, "kvTokens": 65536, "concurrency": 8}}],
        "entitlements": [{"name": "e", "tenantId": "acme", "pool": "p",
                          "serviceClass": "spot"}],
        "tenants": [{"id": "acme", "keys": [{"hash": hash_key("sk-acme")}]}],
    }  # fmt: skip


async def per_request_us(auth: Authenticator, directory: Directory, bearers: list[str]) -> float:
    requests = [
        make_mocked_request(
            "POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {b}"}
        )
        for b in bearers
    ]
    started = time.process_time()
    for request in requests:  # what the gateway does per request
        shown = Credentials(request.headers, request.remote)
        assert isinstance(await auth.caller(shown, directory), Caller)
    return (time.process_time() - started) / len(requests) * 1e6


async def measure(n: int, repeats: int, out: Path) -> dict[str, Any]:
    private = keys()
    jwks = {"keys": []}
    for alg, key in private.items():
        jwk = json.loads(jwt.get_algorithm_by_name(alg).to_jwk(key.public_key()))
        jwks["keys"].append({**jwk, "kid": alg, "alg": alg})
    jwks_file = out.with_suffix(".jwks.json")
    jwks_file.write_text(json.dumps(jwks))
    cfg = parse_config(config(jwks_file))
    directory = Directory(cfg)
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": AUDIENCE, "tenant": "acme", "sub": "svc", "exp": now + 3600}
    bearers = {"API key": ["sk-acme"] * n}
    for alg, key in private.items():
        same = jwt.encode(claims, key, algorithm=alg, headers={"kid": alg})
        bearers[f"JWT {alg}, the same token each request"] = [same] * n
        bearers[f"JWT {alg}, a new token each request"] = [
            jwt.encode({**claims, "jti": str(i)}, key, algorithm=alg, headers={"kid": alg})
            for i in range(n)
        ]
    rows: dict[str, Any] = {}
    for name, tokens in bearers.items():
        runs = []
        for _ in range(repeats):
            auth = Authenticator(cfg.gateway)  # nothing verified yet
            runs.append(await per_request_us(auth, directory, tokens))
        rows[name] = {"median_us": round(statistics.median(runs), 1),
                      "min_us": round(min(runs), 1), "max_us": round(max(runs), 1)}  # fmt: skip
    jwks_file.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse_args(parser, SMOKE)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(measure(args.requests, args.repeats, args.json))
    args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
