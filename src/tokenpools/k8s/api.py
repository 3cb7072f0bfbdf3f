"""A thin dict-in, dict-out layer over the official Kubernetes client.

The official client gives configuration (kubeconfig, in-cluster service account), auth, TLS
and the HTTP transport; the operator and the gateway work with plain dicts, as the
manifests are written, so this layer only builds paths and decodes JSON.
"""

from __future__ import annotations

import builtins
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tokenpools.k8s.schema import API_VERSION, BUDGET_PLURAL, ENTITLEMENT_PLURAL, POOL_PLURAL

MERGE = "application/merge-patch+json"
# an object name as the API server accepts it in a path (DNS subdomain, and the few kinds that
# also allow ':' or upper case); nothing that could be '..', a '/', '%', '?' or '#'
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.:]{0,251}[A-Za-z0-9])?$")


class ObjectMeta(TypedDict, total=False):
    """An object's metadata, the fields the operator and the gateway read or write."""

    name: str
    namespace: str
    uid: str
    resourceVersion: str
    generation: int
    creationTimestamp: str
    deletionTimestamp: str
    labels: dict[str, str]
    annotations: dict[str, str]
    finalizers: list[str]
    ownerReferences: list[dict[str, Any]]


class KubeObject(TypedDict, total=False):
    """An object as the API server reads and writes it (spec, status and a Secret's data stay
    free-form here: each kind's own module checks the shape it needs)."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: dict[str, Any]
    status: dict[str, Any]
    data: dict[str, str]


@dataclass(frozen=True)
class Kind:
    api_version: str  # "v1", "apps/v1", "tokenpools.io/v1alpha1"
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        for segment in (namespace, name):
            if segment is not None and not _NAME.match(segment):
                # a name can come from what a tenant wrote (an entitlement's pool): it must
                # never walk the request elsewhere on the API server with our credentials
                raise ValueError(f"not a Kubernetes object name: {segment[:80]!r}")
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        ns = f"/namespaces/{namespace}" if self.namespaced and namespace else ""
        tail = f"/{name}" if name else ""
        return f"{root}{ns}/{self.plural}{tail}{'/' + sub if sub else ''}"


POOLS = Kind(API_VERSION, POOL_PLURAL, namespaced=False)
ENTITLEMENTS = Kind(API_VERSION, ENTITLEMENT_PLURAL)
BUDGETS = Kind(API_VERSION, BUDGET_PLURAL, namespaced=False)
PODS = Kind("v1", "pods")
NODES = Kind("v1", "nodes", namespaced=False)
SECRETS = Kind("v1", "secrets")
NAMESPACES = Kind("v1", "namespaces", namespaced=False)
EVENTS = Kind("v1", "events")
LEASES = Kind("coordination.k8s.io/v1", "leases")
PRIORITY_CLASSES = Kind("scheduling.k8s.io/v1", "priorityclasses", namespaced=False)


def workload_kind(api_version: str, kind: str) -> Kind:
    """The resource of a scaleTargetRef (Deployment → deployments, the usual plural rule)."""
    plural = kind.lower()
    plural = plural + "es" if plural.endswith("s") else plural + "s"
    return Kind(api_version, plural)


class Conflict(Exception):
    """409: the object changed (resourceVersion) or already exists."""


def load_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster service account when there is one, else the kubeconfig."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient, timeout_s: float = 10.0) -> None:
        self.api = api
        self.timeout_s = timeout_s

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        _, url, headers, body, _ = self.api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self.api.call_api(method, url, headers, body, _request_timeout=self.timeout_s)
            resp.read()  # type: ignore[no-untyped-call]
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(str(exc.reason)) from exc
            raise
        if resp.status == 409:
            raise Conflict(str(resp.data))
        if resp.status >= 400:
            raise ApiException(status=resp.status, reason=resp.reason, http_resp=resp)
        return json.loads(resp.data) if resp.data else None

    def watch(
        self,
        kind: Kind,
        namespace: str | None,
        resource_version: str,
        timeout_s: int,
        labels: Mapping[str, str] | None = None,
    ) -> Iterator[Any]:
        """The watch events after `resource_version`, one dict per line, until the server
        ends the stream (after `timeout_s`); only objects with `labels`, when given (an object
        that loses them comes as DELETED)."""
        query: dict[str, Any] = {
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": timeout_s,
            "allowWatchBookmarks": "true",
        }
        if labels:
            query["labelSelector"] = selector(labels)
        _, url, headers, _, _ = self.api.param_serialize(
            "GET", kind.path(namespace), query_params=list(query.items()),
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
        )  # fmt: skip
        resp = self.api.call_api("GET", url, headers, _request_timeout=(5, timeout_s + 10))
        if resp.status >= 400:
            resp.read()  # type: ignore[no-untyped-call]
            raise ApiException(status=resp.status, reason=resp.reason, http_resp=resp)
        pending = b""
        try:
            for chunk in resp.response.stream(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        finally:
            resp.response.release_conn()

    def get(self, kind: Kind, namespace: str | None, name: str, sub: str = "") -> KubeObject:
        return _object(self.request("GET", kind.path(namespace, name, sub)))

    def find(self, kind: Kind, namespace: str | None, name: str) -> KubeObject | None:
        try:
            return self.get(kind, namespace, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self,
        kind: Kind,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
        fields: Mapping[str, str] | None = None,
    ) -> list[KubeObject]:
        return self.list_with_version(kind, namespace, labels, fields)[0]

    def list_with_version(
        self,
        kind: Kind,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
        fields: Mapping[str, str] | None = None,
        page: int = 500,
    ) -> tuple[builtins.list[KubeObject], str]:
        """Every matching object, read in pages of `page` (the API server's `limit` and
        `continue`), and the list's resourceVersion to watch from."""
        query: dict[str, Any] = {"limit": page}
        if labels:
            query["labelSelector"] = selector(labels)
        if fields:
            query["fieldSelector"] = ",".join(f"{k}={v}" for k, v in fields.items())
        items: builtins.list[KubeObject] = []
        while True:
            listing = self.request("GET", kind.path(namespace), query=query)
            items += listing["items"]
            token = (listing.get("metadata") or {}).get("continue")
            if not token:
                break
            query["continue"] = token
        if labels:  # a server that ignores selectors must not widen what we act on
            items = [i for i in items if has_labels(i, labels)]
        return items, str((listing.get("metadata") or {}).get("resourceVersion") or "")

    def create(self, kind: Kind, namespace: str | None, obj: Mapping[str, Any]) -> KubeObject:
        return _object(self.request("POST", kind.path(namespace), obj))

    def replace(
        self, kind: Kind, namespace: str | None, name: str, obj: Mapping[str, Any]
    ) -> KubeObject:
        return _object(self.request("PUT", kind.path(namespace, name), obj))

    def patch(
        self, kind: Kind, namespace: str | None, name: str, patch: Mapping[str, Any], sub: str = ""
    ) -> KubeObject:
        return _object(
            self.request("PATCH", kind.path(namespace, name, sub), patch, content_type=MERGE)
        )

    def delete(
        self, kind: Kind, namespace: str | None, name: str, grace_s: int | None = None
    ) -> None:
        query = {} if grace_s is None else {"gracePeriodSeconds": grace_s}
        try:
            self.request("DELETE", kind.path(namespace, name), query=query)
        except ApiException as exc:
            if exc.status != 404:
                raise


def _object(answer: Any) -> KubeObject:
    """The object the API server answered with: a JSON object, or a clear error."""
    if not isinstance(answer, dict):
        raise ValueError(f"the API server answered with {type(answer).__name__}, not an object")
    return answer  # type: ignore[return-value]  # the kind's own module checks its fields


def selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def has_labels(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())
