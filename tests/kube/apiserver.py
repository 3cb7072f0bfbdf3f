"""A Kubernetes API server stand-in: kmock 0.8's discovery and HTTP plumbing, with the object
semantics the operator depends on added here (kmock's own store lacks them; see
docs/kubernetes.md): uid / resourceVersion / generation / creationTimestamp stamping,
namespaced and cluster objects, PUT with resourceVersion preconditions (409), JSON merge
patches, `/status` and `/scale` subresources that touch only their part, `pods/NAME/binding`,
graceful deletion of bound pods and finalizers, label and field selectors (an object that
leaves a watch's selection comes to it as DELETED), and watches that
resume from a resourceVersion and end after timeoutSeconds, lists paged by `limit` and
`continue`, and writes that change nothing keep the object's resourceVersion (no event).

To make the operator's failure handling testable it also injects faults (`Fault`: a status
code and latency by verb, resource and namespace, at a rate, from a seeded generator) and
answers a watch from a compacted resourceVersion with 410 Gone (`compact()`).

No admission, defaulting or garbage collection: the tests do those steps explicitly. Like the
real server, it stores a pod's `tokenpools.io/*` quantities in canonical form ("40000" reads
back as "40k").
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import random
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import parsing, rendering  # pinned kmock==0.8: private modules

from tests.kube.api_faults import REASONS, VERBS, Fault
from tokenpools.k8s.quantity import canonical, whole

_parse_path = parsing.parse_path


def _lenient_parse_path(path: str) -> parsing.ParsedPath:
    """kmock 0.8 fails on the Namespace collection itself (`/api/v1/namespaces`): it wants a
    name after "namespaces". Its parse only feeds kmock's request log; we route by the URL."""
    try:
        return _parse_path(path)
    except ValueError:
        return _parse_path(path.rstrip("/") + "/-")


parsing.parse_path = _lenient_parse_path

# group/version, plural → (kind, namespaced, subresources)
RESOURCES: dict[tuple[str, str], tuple[str, bool, tuple[str, ...]]] = {
    ("v1", "pods"): ("Pod", True, ("status", "binding")),
    ("v1", "nodes"): ("Node", False, ("status",)),
    ("v1", "secrets"): ("Secret", True, ()),
    ("v1", "events"): ("Event", True, ()),
    ("v1", "namespaces"): ("Namespace", False, ()),
    ("apps/v1", "deployments"): ("Deployment", True, ("status", "scale")),
    ("coordination.k8s.io/v1", "leases"): ("Lease", True, ()),
    ("scheduling.k8s.io/v1", "priorityclasses"): ("PriorityClass", False, ()),
    ("tokenpools.io/v1alpha1", "tokenpools"): ("TokenPool", False, ("status", "scale")),
    ("tokenpools.io/v1alpha1", "tokenentitlements"): ("TokenEntitlement", True, ("status",)),
    ("tokenpools.io/v1alpha1", "tokenbudgets"): ("TokenBudget", False, ("status",)),
    # llm-d's, and the Gateway API Inference Extension's before it moved there
    ("llm-d.ai/v1alpha2", "inferenceobjectives"): ("InferenceObjective", True, ("status",)),
    ("inference.networking.x-k8s.io/v1alpha2", "inferenceobjectives"): (
        "InferenceObjective",
        True,
        ("status",),
    ),
}


def now_iso() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v)
    return out


def _canonical_pod(pod: dict[str, Any]) -> None:
    """A pod's tokenpools.io/* quantities in the canonical form the API server stores: a
    whole number given in decimal form takes the largest decimal suffix that keeps it whole."""
    spec = pod.get("spec") or {}
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            for key in ("requests", "limits"):
                amounts = (c.get("resources") or {}).get(key) or {}
                for name, text in amounts.items():
                    value = whole(text)
                    if (
                        name.startswith("tokenpools.io/")
                        and value is not None
                        and "i" not in str(text)
                    ):
                        amounts[name] = canonical(value)


def _error(status: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": status,
        "reason": reason,
        "message": message,
    }
    return aiohttp.web.json_response(body, status=status)


def _matches(obj: dict[str, Any], query: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, query.get("labelSelector", "").split(",")):
        k, _, v = term.partition("=")
        if labels.get(k) != v.lstrip("="):
            return False
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        path, _, v = term.partition("=")
        value: Any = obj
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if (value or "") != v:
            return False
    return True


class KubeAPI(kmock.KubernetesScaffold):
    """Declares RESOURCES for discovery; serves their objects itself."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for (gv, plural), (kind, namespaced, subs) in RESOURCES.items():
            verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
            info = kmock.ResourceInfo(
                namespaced=namespaced, kind=kind, verbs=verbs, subresources=set(subs)
            )
            self.resources[f"{gv}/{plural}"] = info
        self.store: dict[tuple[str, str], dict[tuple[str | None, str], dict[str, Any]]] = {
            key: {} for key in RESOURCES
        }
        self.history: dict[tuple[str, str], list[tuple[int, str, dict[str, Any]]]] = {
            key: [] for key in RESOURCES
        }
        self.rv = itertools.count(1)
        self.sequence: dict[tuple[str | None, str], int] = {}  # pod → when created / bound
        self.changed = asyncio.Event()  # replaced by a fresh one after each change
        self.faults: list[Fault] = []
        self.random = random.Random(0)
        self.compacted = 0  # a watch from a resourceVersion below this gets 410 Gone
        self.last_rv = 0  # the newest resourceVersion issued (etcd's revision)
        self.writes: list[tuple[str, str, str | None, int]] = []  # verb, plural, ns, status
        # resources answered 404, as a cluster without their CRD answers (a test sets it)
        self.unserved: set[tuple[str, str]] = set()
        self.closing = False  # shutting down: every open watch ends, as the API server's do

    def close_watches(self) -> None:
        self.closing = True
        self.changed.set()

    def compact(self) -> None:
        """As etcd compaction: every resourceVersion seen so far is too old to watch from."""
        self.compacted = self.last_rv

    def _fault(self, verb: str, plural: str, ns: str | None) -> Fault | None:
        for fault in self.faults:
            if fault.matches(verb, plural, ns) and self.random.random() < fault.rate:
                return fault
        return None

    # -- the object store ------------------------------------------------------------------

    async def _emit(self, key: tuple[str, str], kind: str, obj: dict[str, Any]) -> None:
        rv = self.last_rv = next(self.rv)
        obj["metadata"]["resourceVersion"] = str(rv)
        self.history[key].append((rv, kind, copy.deepcopy(obj)))
        self.changed.set()  # wakes every watch waiting on this one
        self.changed = asyncio.Event()

    async def _store(self, key: tuple[str, str], obj: dict[str, Any], kind: str) -> None:
        meta = obj["metadata"]
        bound_pod = key == ("v1", "pods") and obj.get("spec", {}).get("nodeName")
        if kind != "DELETED" and meta.get("deletionTimestamp") and not meta.get("finalizers"):
            kind = "MODIFIED" if bound_pod else "DELETED"  # its kubelet ends a bound pod
        if kind == "DELETED":
            self.store[key].pop((meta.get("namespace"), meta["name"]), None)
        else:
            self.store[key][(meta.get("namespace"), meta["name"])] = obj
        await self._emit(key, kind, obj)

    # -- HTTP -----------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.strip("/").split("/")
        if path[0] == "api" and len(path) > 2:
            gv, rest = "v1", path[2:]
        elif path[0] == "apis" and len(path) > 3:
            gv, rest = f"{path[1]}/{path[2]}", path[3:]
        else:
            return await super()._handle(request)
        ns = None
        if rest[0] == "namespaces" and len(rest) > 2:
            ns, rest = rest[1], rest[2:]
        key = (gv, rest[0])
        if key not in RESOURCES or key in self.unserved:
            return _error(404, "NotFound", f"the server could not find resource {key}")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else ""
        query = dict(request.params)
        assert request._raw_request is not None
        method = request._raw_request.method.upper()
        body = request.data
        verb = VERBS.get(method, "watch" if query.get("watch") in ("true", "1") else "get")
        fault = self._fault(verb, rest[0], ns)
        if fault is not None:
            if fault.latency_s:
                await asyncio.sleep(fault.latency_s)
            if fault.status >= 400:
                if method in VERBS:
                    self.writes.append((verb, rest[0], ns, fault.status))
                reason = REASONS.get(fault.status, "InternalError")
                return _error(fault.status, reason, f"injected fault on {verb} {rest[0]}")
        if method in VERBS:
            self.writes.append((verb, rest[0], ns, 200))
        if name is None and method == "GET" and query.get("watch") in ("true", "1"):
            assert request._raw_request is not None
            return await self._watch(request._raw_request, key, ns, query)
        if name is None and method == "GET":
            items = [
                o
                for o in self.store[key].values()
                if (ns is None or o["metadata"].get("namespace") == ns) and _matches(o, query)
            ]
            rv = str(self.last_rv)  # as etcd's revision: never below a compaction
            start = int(query.get("continue") or 0)
            limit = int(query.get("limit") or 0) or len(items) or 1
            page, more = items[start : start + limit], start + limit < len(items)
            meta = {"resourceVersion": rv, **({"continue": str(start + limit)} if more else {})}
            return aiohttp.web.json_response(
                {"kind": f"{RESOURCES[key][0]}List", "apiVersion": gv, "metadata": meta,
                 "items": page}
            )  # fmt: skip
        if name is None and method == "POST":
            return await self._create(key, ns, body)
        assert name is not None
        current = self.store[key].get((ns, name))
        if current is None:
            return _error(404, "NotFound", f'{rest[0]} "{name}" not found')
        if method == "GET":
            return aiohttp.web.json_response(self._scale(current) if sub == "scale" else current)
        if method == "POST" and sub == "binding":
            return await self._bind(key, current, body)
        if method == "DELETE":
            return await self._delete(key, current, query)
        if method == "PUT":
            if body["metadata"].get("resourceVersion") not in (
                None,
                current["metadata"]["resourceVersion"],
            ):
                return _error(409, "Conflict", "the object has been modified")
            new = self._apply(key, current, body, sub, replace=True)
        elif method == "PATCH":
            patch = json.loads(request.text) if request.text else {}
            if sub == "scale":
                patch = {"spec": {"replicas": patch["spec"]["replicas"]}}
                sub = ""
            new = self._apply(key, current, patch, sub, replace=False)
        else:
            return _error(405, "MethodNotAllowed", method)
        if new == current:  # nothing changed: no new resourceVersion, no watch event
            return aiohttp.web.json_response(self._scale(new) if sub == "scale" else new)
        await self._store(key, new, "MODIFIED")
        return aiohttp.web.json_response(self._scale(new) if sub == "scale" else new)

    def _apply(
        self,
        key: tuple[str, str],
        current: dict[str, Any],
        change: dict[str, Any],
        sub: str,
        replace: bool,
    ) -> dict[str, Any]:
        new = copy.deepcopy(current)
        if sub == "status":  # only the status changes; the rest of the change is ignored
            status = change.get("status", {})
            new["status"] = copy.deepcopy(status) if replace else merge(new.get("status"), status)
            return new
        merged = copy.deepcopy(change) if replace else merge(new, change)
        for field in (
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "generation",
            "deletionTimestamp",
        ):
            if field in current["metadata"]:
                merged.setdefault("metadata", {})[field] = current["metadata"][field]
        if "status" in RESOURCES[key][2]:  # the main endpoint does not write the status
            merged["status"] = current.get("status", {})
        if key == ("v1", "pods"):
            _canonical_pod(merged)
        if merged.get("spec") != current.get("spec"):
            merged["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        return merged

    @staticmethod
    def _scale(obj: dict[str, Any]) -> dict[str, Any]:
        meta = {
            k: obj["metadata"][k]
            for k in ("name", "namespace", "resourceVersion")
            if k in obj["metadata"]
        }
        status = obj.get("status", {})
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": meta,
            "spec": {"replicas": obj.get("spec", {}).get("replicas", 0)},
            "status": {"replicas": status.get("replicas", 0)},
        }

    async def _create(
        self, key: tuple[str, str], ns: str | None, body: dict[str, Any]
    ) -> aiohttp.web.StreamResponse:
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        namespaced = RESOURCES[key][1]
        if namespaced:
            meta["namespace"] = ns or meta.get("namespace") or "default"
        if (meta.get("namespace"), meta["name"]) in self.store[key]:
            return _error(409, "AlreadyExists", f'"{meta["name"]}" already exists')
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
        body.setdefault("apiVersion", key[0])
        body.setdefault("kind", RESOURCES[key][0])
        if key == ("scheduling.k8s.io/v1", "priorityclasses"):
            body.setdefault("preemptionPolicy", "PreemptLowerPriority")
        if key == ("v1", "pods"):
            _canonical_pod(body)
        await self._store(key, body, "ADDED")
        self.sequence[(meta.get("namespace"), meta["name"])] = next(self.rv)
        return aiohttp.web.json_response(body, status=201)

    async def _bind(
        self, key: tuple[str, str], pod: dict[str, Any], body: dict[str, Any]
    ) -> aiohttp.web.StreamResponse:
        if pod["spec"].get("nodeName"):
            return _error(409, "Conflict", "pod is already assigned to a node")
        new = copy.deepcopy(pod)
        new["spec"]["nodeName"] = body["target"]["name"]
        conds = [
            c for c in new.get("status", {}).get("conditions", []) if c["type"] != "PodScheduled"
        ]
        new.setdefault("status", {})["conditions"] = [
            *conds,
            {"type": "PodScheduled", "status": "True"},
        ]
        await self._store(key, new, "MODIFIED")
        self.sequence[(new["metadata"]["namespace"], new["metadata"]["name"])] = next(self.rv)
        return aiohttp.web.json_response({"kind": "Status", "status": "Success"}, status=201)

    async def _delete(
        self, key: tuple[str, str], obj: dict[str, Any], query: dict[str, str]
    ) -> aiohttp.web.StreamResponse:
        new = copy.deepcopy(obj)
        meta = new["metadata"]
        graceful = (
            key == ("v1", "pods")
            and new["spec"].get("nodeName")
            and query.get("gracePeriodSeconds") != "0"
        )
        if meta.get("finalizers") or graceful:
            meta.setdefault("deletionTimestamp", now_iso())  # the kubelet or a controller ends it
            await self._store(key, new, "MODIFIED")
        else:
            await self._store(key, new, "DELETED")
        return aiohttp.web.json_response(new)

    async def _watch(
        self,
        raw: aiohttp.web.BaseRequest,
        key: tuple[str, str],
        ns: str | None,
        query: dict[str, str],
    ) -> aiohttp.web.StreamResponse:
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(raw)
        since = int(query.get("resourceVersion") or 0)
        if since and since < self.compacted:
            why = f"too old resource version {since}"
            gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                    "reason": "Expired", "message": why}  # fmt: skip
            await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            await resp.write_eof()
            return resp
        if not since:  # a fresh watch: every object as ADDED, then the changes
            for obj in list(self.store[key].values()):
                if (ns is None or obj["metadata"].get("namespace") == ns) and _matches(obj, query):
                    await resp.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            since = self.history[key][-1][0] if self.history[key] else 0
        deadline = asyncio.get_running_loop().time() + float(query.get("timeoutSeconds") or 300)
        try:
            while True:
                changed = self.changed  # set by any change from here on, scanned or not
                for rv, kind, obj in [h for h in self.history[key] if h[0] > since]:
                    since = rv
                    if ns is not None and obj["metadata"].get("namespace") != ns:
                        continue
                    if not _matches(obj, query):  # as the API server: one that leaves the
                        if kind != "MODIFIED" or not self._matched_before(key, rv, obj, query):
                            continue  # selection is DELETED for this watch
                        kind = "DELETED"
                    await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0 or self.closing:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout=min(left, 1.0))
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        await resp.write_eof()
        return resp

    def _matched_before(
        self, key: tuple[str, str], rv: int, obj: dict[str, Any], query: dict[str, str]
    ) -> bool:
        """Whether the version of `obj` before `rv` was in the watch's selection."""
        meta = obj["metadata"]
        for old_rv, kind, old in reversed(self.history[key]):
            same = (old["metadata"].get("namespace"), old["metadata"]["name"]) == (
                meta.get("namespace"), meta["name"]
            )  # fmt: skip
            if old_rv < rv and same:
                return kind != "DELETED" and _matches(old, query)
        return False


class ServerThread:
    """The stand-in on a loopback port, in its own thread and event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.api: KubeAPI
        self.url = ""

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        # end the watches still streaming, so no handler is destroyed mid-wait
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    async def _serve(self) -> None:
        self.stop_event = asyncio.Event()
        async with KubeAPI() as api, kmock.Server(api) as server:
            self.api = api
            self.url = str(server.url).rstrip("/")
            self.ready.set()
            await self.stop_event.wait()
            # a client that stopped watching may leave its stream open: the server's shutdown
            # would wait for it (seconds on each test's teardown)
            api.close_watches()

    def start(self) -> ServerThread:
        self.thread.start()
        self.ready.wait(10)
        return self

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(10)
