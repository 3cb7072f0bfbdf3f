"""`tokenpools k8s` (CRDs, a config file as custom resources) and `tokenpools operator`."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from tokenpools.commands.common import fail
from tokenpools.model.config import ConfigError, load_config

k8s_app = typer.Typer(help="Kubernetes: CRDs, and a config file as custom resources.")


class ObjectiveApi(StrEnum):
    """Where the cluster's InferenceObjective kind lives (k8s/inference_objectives.py)."""

    LLM_D = "llm-d.ai/v1alpha2"
    LEGACY = "inference.networking.x-k8s.io/v1alpha2"


_NAMESPACE = typer.Option(help="the platform's namespace, where the InferencePools are")
_API = typer.Option(help="the InferenceObjective API your endpoint picker reads")


@k8s_app.command("crds")
def k8s_crds() -> None:
    """Print the TokenPool and TokenEntitlement CRDs (generated from the config schema)."""
    from tokenpools.k8s.crds import crds
    from tokenpools.k8s.manifests import dump_all

    typer.echo(dump_all(crds()), nl=False)


@k8s_app.command("render")
def k8s_render(
    config: Annotated[Path, typer.Argument(help="a tokenpools YAML config")],
    objectives: Annotated[
        bool, typer.Option(help="each pool's llm-d InferenceObjectives too")
    ] = True,
    namespace: Annotated[str, _NAMESPACE] = "tokenpools-system",
    objective_api: Annotated[ObjectiveApi, _API] = ObjectiveApi.LLM_D,
) -> None:
    """Print the TokenPools and TokenEntitlements for an existing config file: each
    entitlement in the namespace named by its tenantId, each pool open to those namespaces,
    key hashes in the entitlements; and one InferenceObjective per pool and service class
    (the operator makes and adopts them too)."""
    from tokenpools.k8s.custom_resources import render
    from tokenpools.k8s.manifests import dump_all

    document = _checked(config)
    try:
        objects = render(document, namespace if objectives else None, objective_api.value)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(dump_all(objects), nl=False)
    kept = [s for s in ("tenants", "gateway", "usage") if s in document]
    if kept:  # platform settings, never a tenant's to write: no custom resource holds them
        typer.echo(
            f"note: {', '.join(kept)} stay in the gateway's own config (tokenpools serve "
            "--kubernetes --config FILE); in a cluster a tenant is its namespace and an "
            "entitlement is <namespace>/<name> (docs/identity.md, docs/budgets.md)",
            err=True,
        )


@k8s_app.command("objectives")
def k8s_objectives(
    config: Annotated[Path, typer.Argument(help="a tokenpools YAML config")],
    namespace: Annotated[str, _NAMESPACE] = "tokenpools-system",
    objective_api: Annotated[ObjectiveApi, _API] = ObjectiveApi.LLM_D,
) -> None:
    """Print only the InferenceObjectives of a config file's pools: for `tokenpools extproc`
    in front of llm-d without the operator (its InferencePools named as the pools)."""
    from tokenpools.k8s.inference_objectives import inference_objectives
    from tokenpools.k8s.manifests import dump_all

    document = _checked(config)
    objects = [
        objective
        for pool in document.get("pools", [])
        for objective in inference_objectives(pool["name"], namespace, None, objective_api.value)
    ]
    typer.echo(dump_all(objects), nl=False)


def _checked(config: Path) -> dict[str, Any]:
    try:
        load_config(config)  # the same validation as `check-config`
    except ConfigError as exc:
        fail(str(exc))
    document: dict[str, Any] = yaml.safe_load(config.read_text())
    return document


def operator(
    namespace: Annotated[
        str, typer.Option(help="where the leader Lease lives")
    ] = "tokenpools-system",
    installation: Annotated[
        str | None,
        typer.Option(
            help="this installation's id, the label tokenpools.io/installation of its virtual "
            "nodes (default: $TOKENPOOLS_INSTALLATION, else the namespace)"
        ),
    ] = None,
    binding_grace: Annotated[
        float | None,
        typer.Option(
            help="seconds a Bound entitlement keeps its binding once its pool no longer admits "
            "its namespace (default: $TOKENPOOLS_BINDING_GRACE_S, else 3600)"
        ),
    ] = None,
) -> None:
    """Run the Kubernetes operator (kopf): virtual nodes, lease pods, autoscaling."""
    import os

    os.environ.setdefault("TOKENPOOLS_NAMESPACE", namespace)
    if installation is not None:
        os.environ["TOKENPOOLS_INSTALLATION"] = installation
    if binding_grace is not None:
        os.environ["TOKENPOOLS_BINDING_GRACE_S"] = str(binding_grace)
    import kopf

    import tokenpools.k8s.kopf_operator  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=False)
    kopf.run(clusterwide=True, standalone=True)
