"""What went wrong with an API call, in the words an operator's status and Event should use."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException

from tokenpools.k8s.api import Conflict


def describe(exc: BaseException) -> tuple[str, str]:
    """(a short reason for metrics, a message naming the API error) of any failure."""
    if isinstance(exc, Conflict):
        return "Conflict", f"409 Conflict: {exc}"
    if isinstance(exc, ApiException):
        message = str(exc.reason or "")
        reason = {403: "Forbidden", 404: "NotFound", 410: "Gone", 422: "Invalid"}.get(
            exc.status or 0, f"HTTP{exc.status}"
        )
        try:
            body = json.loads(exc.body or "{}")
            message = body.get("message") or message
            reason = body.get("reason") or reason
        except (ValueError, AttributeError):
            pass
        return str(reason), f"{exc.status} {reason}: {message}"
    return type(exc).__name__, f"{type(exc).__name__}: {exc}"
