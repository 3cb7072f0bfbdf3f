"""A chat or completions request the core may take back (`Lease.resumable`: lent work, and
elastic work after a capacity loss): suspended, not ended (docs/decisions.md, "Lending, and
taking back"). Each engine request is one *segment*, run as its own task so that an eviction
cancels the segment, not the client's exchange: the engine request is aborted (its connection
closed), the client's connection stays open, and what was generated so far is kept
(openai_api/continuation.py). The suspended request asks the front
door again — as one more request, its prompt the original and the text so far — whenever a
request here ends, or at the Retry-After it was given, until its class's deadline; admitted,
its continuation goes to the backend and its output is stitched onto the client's answer.

The engine always streams; a client that did not stream gets one whole answer at the end.
Settlement: each segment's lease ends as any lease does: a suspended one as an eviction ends
it, on its reservation, and is then charged what the client received of it instead
(`Admitted.recharge`: its output, the original prompt with the first): a stream's at once, a
whole answer's when it is known whether the answer is given (nothing if it never is). The last
segment settles on its own output. So the ledger and budgets count each token the client
received once (docs/decisions.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from tokenpools.admission import Admitted, Cleared, Stopped
from tokenpools.control.tenancy import Caller
from tokenpools.gateway.exchange import Exchange
from tokenpools.gateway.responses import answer, error
from tokenpools.model.request import Usage
from tokenpools.openai_api import error_body
from tokenpools.openai_api.answer_tap import event_data, split_events
from tokenpools.openai_api.continuation import Transcript, segment_body
from tokenpools.openai_api.refusals import preempted

log = logging.getLogger("tokenpools.gateway")


class Suspended(Exception):
    """The core took the segment's room back: the segment was cut off."""


class Resumable(Exchange):
    """An Exchange whose segments the core may suspend, for `deadline_s` at a time."""

    def __init__(
        self,
        *args: Any,
        caller: Caller,
        cleared: Cleared,
        deadline_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.caller, self.cleared, self.deadline_s = caller, cleared, deadline_s
        self.transcript = Transcript(self.path, self.prompt_tokens, cleared.client_usage)
        self.response: web.StreamResponse | None = None  # the client's stream, once begun
        self.suspensions = 0
        self.suspended_s = 0.0  # time spent suspended, waiting for room, in all
        self._before = 0  # output tokens of the segments before the one under way
        self._taken: list[tuple[Admitted, Usage]] = []  # suspended segments, what each made
        self._delivered = False  # a whole answer was given (a stream gives as it goes)

    @property
    def recomputed(self) -> int:
        """Prompt tokens the continuations' engines prefilled again (their usage says)."""
        return self.transcript.recomputed

    @property
    def usage(self) -> Usage:
        """What the client received: the original prompt once, every output token once."""
        counts = self.transcript.usage()
        return Usage(counts["prompt_tokens"], counts["completion_tokens"])

    async def run(
        self, request: web.Request, body: dict[str, Any], raw: bytes | None
    ) -> web.StreamResponse:
        del raw  # the engine's body is rewritten for every segment
        next_body = segment_body(self.path, body, None)
        try:
            while True:
                self.transcript.begin()
                try:
                    ended = await self._segment(request, next_body)
                except Suspended:
                    self.transcript.suspended()
                    self.suspensions += 1
                    self._taken_back()
                    since = self.tap.clock()
                    try:
                        resumed = await self._resume()
                    finally:
                        self.suspended_s += self.tap.clock() - since
                    if isinstance(resumed, web.StreamResponse):
                        return resumed
                    self.admitted = resumed.admitted
                    next_body = segment_body(self.path, resumed.body, None)  # continues already
                    continue
                return ended
        finally:
            self._recharge_taken()

    def _taken_back(self) -> None:
        """The segment under way was taken back (its lease ended on its reservation): a
        streaming client has its output already, and it is charged that at once, so that the
        reservation does not hold the tenant's budget while the request waits to resume; a
        client waiting for the whole answer is charged when it is known whether it gets one."""
        if self.response is not None:
            self.admitted.recharge(self._segment_usage())
        else:
            self._taken.append((self.admitted, self._segment_usage()))

    def _recharge_taken(self) -> None:
        """Each suspended segment charged later is charged what the client received of it:
        all of it if the answer was given (a whole answer, or a stream begun after the segment
        was taken back before anything was sent), else nothing."""
        given = self._delivered or self.response is not None
        for admitted, usage in self._taken:
            admitted.recharge(usage if given else Usage(0, 0))
        self._taken.clear()

    async def _segment(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """One engine request; raises Suspended if the core takes it back."""
        self._before = self.transcript.tokens
        segment = asyncio.create_task(self._engine_request(request, body))
        self.admitted.task = segment  # an eviction cancels the segment, not the exchange
        try:
            return await segment
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.admitted.evicted and task is not None and not task.cancelling():
                raise Suspended from None
            segment.cancel()  # the client went away: charged what it was sent
            self._abandon()
            raise

    async def _engine_request(
        self, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse:
        gw, backend, admitted = self.gw, self.backend, self.admitted
        assert gw.session is not None
        if backend.spec.model is not None:
            body = {**body, "model": backend.spec.model}
        headers = {"Content-Type": "application/json", **backend.auth, **self.trace}
        headers["x-request-id"] = self.headers["x-request-id"]
        backend.open_requests += 1
        try:
            async with gw.session.post(
                backend.spec.url + self.path,
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=backend.spec.timeout_s),
            ) as upstream:
                if upstream.status != 200:
                    return await self._refused_upstream(upstream, admitted)
                if self.cleared.stream and self.response is None:
                    self.response = web.StreamResponse(headers=self._passed(upstream.headers))
                    self.response.headers["Cache-Control"] = "no-cache"
                    await self.response.prepare(request)
                await self._read_events(upstream.content)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            return await self._failed(exc, admitted)
        except ConnectionResetError:  # the client went away while we wrote
            self._abandon()
            return self.response or web.Response(status=499)
        finally:
            backend.open_requests -= 1
        admitted.end(self._segment_usage())
        if self.response is not None:
            return self.response
        self._delivered = True
        return web.json_response(self.transcript.whole(), headers=self.headers)

    def _abandon(self) -> None:
        """The segment broke off (the client or the backend went away): it ends on what was
        sent. Taken back as it broke off, its lease has already ended on its reservation."""
        self.transcript.suspended()
        if self.admitted.evicted:
            self._taken_back()
        else:
            self.admitted.end(self._segment_usage(), refund=False)

    def _segment_usage(self) -> Usage:
        """What the segment under way produced. The first segment's lease settles on the
        prompt; a continuation's prompt (the original and the text so far) was counted with
        the first."""
        prompt = self.prompt_tokens if self.transcript.segments == 1 else 0
        return Usage(prompt, self.transcript.tokens - self._before)

    async def _read_events(self, content: aiohttp.StreamReader) -> None:
        pending = b""
        async for chunk in content.iter_any():
            events, pending = split_events(pending + chunk)
            for event in events:
                await self._pass(event)
        if pending:
            await self._pass(pending)

    async def _pass(self, event: bytes) -> None:
        data = event_data(event)
        if data is None:
            return
        if self.tap.first_token_at is None:
            self.tap.first_token_at = self.tap.clock()
        out = self.transcript.read(data)
        if out is not None and self.response is not None:
            await self.response.write(b"data: " + out + b"\n\n")

    async def _refused_upstream(
        self, upstream: aiohttp.ClientResponse, admitted: Admitted
    ) -> web.StreamResponse:
        text = await upstream.read()
        admitted.end(None)
        if self.response is not None:  # a continuation the backend refused mid-answer
            await self._write_error("the backend refused the continuation", "backend_error")
            return self.response
        status = upstream.status if upstream.status < 500 else 502
        return web.Response(status=status, body=text, headers=self._passed(upstream.headers))

    async def _failed(self, exc: Exception, admitted: Admitted) -> web.StreamResponse:
        if self.response is None:
            admitted.end(None)  # refunded: the client gets no answer (nor its earlier segments)
        else:
            self._abandon()  # charged what was sent
        if isinstance(exc, aiohttp.ClientConnectorError):
            self.backend.healthy = False
        if self.response is not None:
            await self._write_error("the backend failed mid-stream", "backend_error")
            return self.response
        return error(502, f"backend error: {exc.__class__.__name__}", "server_error",
                     "backend_error", headers=self.headers)  # fmt: skip

    async def _resume(self) -> Cleared | web.StreamResponse:
        """Ask the front door for the continuation until it is admitted (the Cleared) or the
        deadline passes (the client's ending: a 503 if nothing was sent, else an error event
        that ends the stream)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        door, runtime = self.gw.door, self.gw.admission
        while True:
            body = segment_body(self.path, self.cleared.body, self.transcript)
            result = await door.enter(None, self.caller, self.path, body, task=None)
            if isinstance(result, Cleared):
                return result
            left = deadline - loop.time()
            # refused outright (it never will fit), past its deadline, or the gateway stopping
            if left <= 0 or result.decision is None or runtime.draining:
                return await self._give_up(result)
            wait = result.decision.retry_after_s or 1.0
            await runtime.room(min(wait, left))

    async def _give_up(self, result: Stopped) -> web.StreamResponse:
        log.info("a suspended request passed its deadline: %s", result.refusal.code)
        if self.response is not None:
            await self._write_error(preempted().message, "preempted")
            return self.response
        why = preempted()
        return answer(replace(why, headers=why.headers | self.headers))

    async def _write_error(self, message: str, code: str) -> None:
        assert self.response is not None
        data = b"data: " + error_body(message, "server_error", code) + b"\n\n"
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await self.response.write(data)
