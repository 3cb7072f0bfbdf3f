"""`tokenpools operator`: kopf watches TokenPools, TokenEntitlements, lease pods and namespaces;
every event only wakes the reconciliation task. Two tasks drive the OperatorLoop: the
heartbeat (leader Lease and node heartbeats, every 10 s) and reconciliation (on a wake, or
every 30 s). An aiohttp server gives the probes and `/metrics` on :8080 and, when a
certificate is mounted, the validating admission webhook over HTTPS on :9443.

Why handlers only wake a loop: reconciliation must see the whole pool at once (binding,
eviction and autoscaling are decisions over all its entitlements). kopf gives the watching, the
reconnects, the login from kubeconfig or the service account, and graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

import kopf

from tokenpools.k8s.api import Kube, load_client
from tokenpools.k8s.grace import DEFAULT_GRACE_S
from tokenpools.k8s.leader import LeaderElection
from tokenpools.k8s.objects import LEASE_LABEL
from tokenpools.k8s.operator_http import serve_http
from tokenpools.k8s.operator_loop import HEARTBEAT_S, RESYNC_S, OperatorLoop
from tokenpools.k8s.reconciler import Reconciler
from tokenpools.k8s.schema import BUDGET_PLURAL, ENTITLEMENT_PLURAL, GROUP, POOL_PLURAL, VERSION

log = logging.getLogger("tokenpools.operator")


class _State:
    def __init__(self) -> None:
        self.wake: asyncio.Event | None = None
        self.tasks: list[asyncio.Task[Any]] = []


_state = _State()


def _poke(**_: Any) -> None:
    if _state.wake is not None:
        _state.wake.set()


kopf.on.event(GROUP, VERSION, POOL_PLURAL)(_poke)
kopf.on.event(GROUP, VERSION, ENTITLEMENT_PLURAL)(_poke)
kopf.on.event(GROUP, VERSION, BUDGET_PLURAL)(_poke)
kopf.on.event("", "v1", "pods", labels={LEASE_LABEL: "true"})(_poke)
kopf.on.event("", "v1", "namespaces")(_poke)  # a label change may open or close a pool


@kopf.on.login()
def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The service account in a cluster, else $KUBECONFIG as it is now (the client library's
    own default is read once, when it is imported)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def _start(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.peering.standalone = True  # leader election is ours (a Lease), not kopf peering
    settings.posting.enabled = False
    kube = Kube(load_client(os.environ.get("KUBECONFIG")))
    namespace = os.environ.get("TOKENPOOLS_NAMESPACE", "tokenpools-system")
    identity = os.environ.get("POD_NAME", socket.gethostname())
    installation = os.environ.get("TOKENPOOLS_INSTALLATION")  # default: the namespace
    grace = float(os.environ.get("TOKENPOOLS_BINDING_GRACE_S", DEFAULT_GRACE_S))
    rec = Reconciler(kube, time.time, namespace, installation=installation, binding_grace_s=grace)
    loop = OperatorLoop(rec, LeaderElection(kube, namespace, identity, time.time), time.time)
    _state.wake = asyncio.Event()
    _state.tasks = [
        asyncio.create_task(_heartbeats(loop)),
        asyncio.create_task(_reconciles(loop, _state.wake)),
        asyncio.create_task(serve_http(loop, kube, os.environ)),
    ]


@kopf.on.cleanup()
async def _stop(**_: Any) -> None:
    for task in _state.tasks:
        task.cancel()


async def _heartbeats(loop: OperatorLoop) -> None:
    while True:
        await asyncio.to_thread(loop.heartbeat)
        await asyncio.sleep(HEARTBEAT_S)


async def _reconciles(loop: OperatorLoop, wake: asyncio.Event) -> None:
    while True:
        if loop.reconcile_due(wake.is_set()):
            wake.clear()
            await asyncio.to_thread(loop.reconcile)
        elif not loop.leading:  # a follower: the wake waits for leadership
            await asyncio.sleep(1.0)
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=min(HEARTBEAT_S, RESYNC_S))
