"""`tokenpools operator`: kopf watches TokenPools, TokenEntitlements and lease pods; every
event only wakes one loop, which — while this replica holds the leader Lease — runs the
level-triggered Reconciler and, every 10 s, the virtual nodes' heartbeats.

Why handlers only wake a loop: reconciliation must see the whole pool at once (binding,
eviction and autoscaling are decisions over all its entitlements), and a single loop makes
the leader check and the idempotence trivial to reason about. kopf gives the watching, the
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
from tokenpools.k8s.leader import LeaderElection
from tokenpools.k8s.objects import ENTITLEMENT_LABEL
from tokenpools.k8s.reconciler import Reconciler
from tokenpools.k8s.schema import ENTITLEMENT_PLURAL, GROUP, POOL_PLURAL, VERSION

log = logging.getLogger("tokenpools.operator")
HEARTBEAT_S = 10.0
RESYNC_S = 30.0


class _Loop:
    wake: asyncio.Event | None = None
    task: asyncio.Task[None] | None = None


_loop = _Loop()


def _poke(**_: Any) -> None:
    if _loop.wake is not None:
        _loop.wake.set()


kopf.on.event(GROUP, VERSION, POOL_PLURAL)(_poke)
kopf.on.event(GROUP, VERSION, ENTITLEMENT_PLURAL)(_poke)
kopf.on.event("", "v1", "pods", labels={ENTITLEMENT_LABEL: kopf.PRESENT})(_poke)


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
    leader = LeaderElection(kube, namespace, identity, time.time)
    _loop.wake = asyncio.Event()
    _loop.task = asyncio.create_task(run(Reconciler(kube, time.time), leader, _loop.wake))


@kopf.on.cleanup()
async def _stop(**_: Any) -> None:
    if _loop.task is not None:
        _loop.task.cancel()


async def run(rec: Reconciler, leader: LeaderElection, wake: asyncio.Event) -> None:
    last_full = 0.0
    while True:
        try:
            if await asyncio.to_thread(leader.try_acquire):
                if wake.is_set() or time.monotonic() - last_full >= RESYNC_S:
                    wake.clear()
                    await asyncio.to_thread(rec.reconcile)
                    last_full = time.monotonic()
                else:
                    await asyncio.to_thread(rec.heartbeat)
        except Exception:  # one failed round must not stop the node's heartbeat
            log.exception("reconciliation failed; retrying")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=HEARTBEAT_S)
