"""`tokenpools k8s` (CRDs, a config file as custom resources) and `tokenpools operator`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml

from tokenpools.commands.common import fail
from tokenpools.model.config import ConfigError, load_config

k8s_app = typer.Typer(help="Kubernetes: CRDs, and a config file as custom resources.")


@k8s_app.command("crds")
def k8s_crds() -> None:
    """Print the TokenPool and TokenEntitlement CRDs (generated from the config schema)."""
    from tokenpools.k8s.crds import crds
    from tokenpools.k8s.manifests import dump_all

    typer.echo(dump_all(crds()), nl=False)


@k8s_app.command("render")
def k8s_render(
    config: Annotated[Path, typer.Argument(help="a tokenpools YAML config")],
) -> None:
    """Print the TokenPools and TokenEntitlements for an existing config file: each
    entitlement in the namespace named by its tenantId, each pool open to those namespaces,
    key hashes in the entitlements."""
    from tokenpools.k8s.custom_resources import render
    from tokenpools.k8s.manifests import dump_all

    try:
        load_config(config)  # the same validation as `check-config`
    except ConfigError as exc:
        fail(str(exc))
    document = yaml.safe_load(config.read_text())
    try:
        objects = render(document)
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


def operator(
    namespace: Annotated[
        str, typer.Option(help="where the leader Lease lives")
    ] = "tokenpools-system",
) -> None:
    """Run the Kubernetes operator (kopf): virtual nodes, lease pods, autoscaling."""
    import os

    os.environ.setdefault("TOKENPOOLS_NAMESPACE", namespace)
    import kopf

    import tokenpools.k8s.kopf_operator  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=False)
    kopf.run(clusterwide=True, standalone=True)
