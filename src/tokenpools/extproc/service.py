"""The gRPC face of the processor: Envoy's `ExternalProcessor.Process` stream, one per HTTP
request, each message handed to that request's `Flow` and its answer sent back; and gRPC
health as the endpoint picker protocol asks (liveness, and readiness under the processor's
service name, which Envoy's health check of the cluster reads)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2

from tokenpools.extproc.flow import Waker
from tokenpools.extproc.processor import Processor

log = logging.getLogger("tokenpools.extproc")
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # untyped
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    async def Process(  # the name gRPC gives the method
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[ep.ProcessingRequest, ep.ProcessingResponse],
    ) -> AsyncIterator[ep.ProcessingResponse]:
        flow = self.processor.flow()
        try:
            while True:
                if flow.evicted:  # while gRPC sent an answer: it ends now
                    yield flow.preempted()
                    return
                try:
                    request = await _next(request_iterator, flow.waker)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not flow.evicted:  # the stream itself was cancelled
                        raise
                    yield flow.preempted()  # evicted while it waited for Envoy
                    return
                for response in await flow.receive(request):
                    yield response
                if flow.done:  # answered at once, or passed on unadmitted
                    return
        finally:
            record = flow.finish()
            if record is not None:
                self.processor.finished(record)


async def _next(
    request_iterator: AsyncIterator[ep.ProcessingRequest], waker: Waker | None
) -> ep.ProcessingRequest:
    """Envoy's next message, the admitted flow's `waker` armed while the stream waits for it:
    only there may an eviction cancel the stream's task."""
    if waker is None:
        return await anext(request_iterator)
    waker.waiting = True
    try:
        return await anext(request_iterator)
    finally:
        waker.waiting = False


class Health:
    """gRPC health: liveness while the process runs; the processor's service and readiness
    while it admits (started, and the state store answers)."""

    def __init__(self, processor: Processor) -> None:
        self.processor = processor
        self.servicer = health.aio.HealthServicer()
        self._watching: asyncio.Task[None] | None = None

    async def start(self, interval_s: float = 2.0) -> None:
        await self._set(LIVENESS, True)
        await self._set("", True)
        self._watching = asyncio.create_task(self._watch(interval_s))

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        for name in (SERVICE_NAME, READINESS, LIVENESS, ""):
            await self._set(name, False)

    async def _watch(self, interval_s: float) -> None:
        while True:
            try:
                ready = await self.processor.ready()
            except Exception:
                log.exception("readiness check failed")
                ready = False
            await self._set(SERVICE_NAME, ready)
            await self._set(READINESS, ready)
            await asyncio.sleep(interval_s)

    async def _set(self, name: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        await self.servicer.set(name, status.SERVING if serving else status.NOT_SERVING)
