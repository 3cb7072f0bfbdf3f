"""Faults the API server stand-in injects: a status code and latency by verb, resource and
namespace, at a rate (the stand-in draws from a seeded generator)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Fault:
    """Fail (or slow down) the requests that match: verb (e.g. "create", "patch"; "write" any
    of create/update/patch/delete; "*" any), plural ("pods"; "*" any), namespace (None: any),
    at `rate` (0..1)."""

    verb: str = "*"
    plural: str = "*"
    namespace: str | None = None
    status: int = 500
    rate: float = 1.0
    latency_s: float = 0.0

    def matches(self, verb: str, plural: str, namespace: str | None) -> bool:
        return (
            (self.verb in ("*", verb) or (self.verb == "write" and verb in VERBS.values()))
            and self.plural in ("*", plural)
            and self.namespace in (None, namespace)
        )


VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
REASONS = {403: "Forbidden", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}  # fmt: skip
