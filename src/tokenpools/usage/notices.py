"""Budget notices: when a budget's window reaches one of its thresholds (say 80 % and 100 %),
one notice per budget, window and threshold — across every replica, the store claims it — is
logged and POSTed to the configured webhook, signed, and retried with backoff.

The signature: `x-tokenpools-signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">`
with the secret, and the timestamp in `x-tokenpools-timestamp`, so a receiver can refuse
replays. The webhook URL is the platform's config, never a tenant's; the POST carries no
credential of the gateway's."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from tokenpools.backoff import doubled
from tokenpools.control.budgets import claim_notices
from tokenpools.control.core import DecisionCore
from tokenpools.control.store import StoreUnavailable
from tokenpools.model.budgets import Webhook

log = logging.getLogger("tokenpools.budgets")
Sleep = Callable[[float], Awaitable[None]]
NOTICE_BACKOFF_MAX_S = 60.0  # between a webhook's attempts: 1 s doubling to this


def signature(secret: bytes, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


class Notifier:
    def __init__(self, sleep: Sleep = asyncio.sleep) -> None:
        self._sleep = sleep
        self._sending: set[asyncio.Task[bool]] = set()
        self.sent = 0  # notices delivered (the webhook answered 2xx)

    async def check(
        self, core: DecisionCore, run: Any, webhook: Webhook | None, now: float
    ) -> None:
        """Claim what is due (`run` runs store work where the host runs it) and send it."""
        if not core.budgets:
            return
        try:
            notices = await run(claim_notices, core, now)
        except StoreUnavailable:
            return
        for notice in notices:
            log.warning(
                "budget %s reached %d%% of its %s window: used %g, held %g of %g",
                notice["name"], round(notice["threshold"] * 100), notice["window"],
                notice["used"], notice["held"], notice["limit"],
            )  # fmt: skip
            if webhook is not None:
                task = asyncio.get_running_loop().create_task(self.post(webhook, notice))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

    async def post(self, webhook: Webhook, notice: dict[str, Any]) -> bool:
        body = json.dumps({"type": "budget.threshold", **notice}, sort_keys=True).encode()
        timestamp = str(int(notice["time"]))
        headers = {"content-type": "application/json", "x-tokenpools-timestamp": timestamp}
        if webhook.secret:
            headers["x-tokenpools-signature"] = signature(webhook.secret, timestamp, body)
        timeout = aiohttp.ClientTimeout(total=webhook.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:  # its own: no credentials
            for attempt in range(webhook.attempts):
                try:
                    async with session.post(webhook.url, data=body, headers=headers) as answer:
                        if 200 <= answer.status < 300:
                            self.sent += 1
                            return True
                        why = f"answered {answer.status}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    why = f"{exc.__class__.__name__}: {exc}"
                log.warning(
                    "budget notice %s to %s: %s (attempt %d of %d)",
                    notice["name"], webhook.url, why, attempt + 1, webhook.attempts,
                )  # fmt: skip
                if attempt + 1 < webhook.attempts:
                    await self._sleep(doubled(1.0, attempt, NOTICE_BACKOFF_MAX_S))
        return False

    async def aclose(self) -> None:
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
