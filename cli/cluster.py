"""``gpufleet cluster ...``: commands about the Kubernetes cluster itself."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

cluster_app = typer.Typer(no_args_is_help=True)


@cluster_app.callback()
def cluster() -> None:
    """The Kubernetes cluster gpufleet runs (real mode)."""


@cluster_app.command("check")
def check(
    kubeconfig: str = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG",
                                   help="kubeconfig file(s), ':'-separated (default: in-cluster, then ~/.kube/config)"),
    context: str = typer.Option(None, "--context", help="kubeconfig context"),
    namespace: str = typer.Option("gpufleet", "--namespace", "-n", help="namespace of serving and routing objects"),
) -> None:
    """Check that these credentials may do everything the cluster adapter does.

    Exit 0 when every permission is granted, 1 when any is missing, 2 when the
    cluster cannot be asked.
    """
    from providers.cluster.check import check_access
    from providers.cluster.kubernetes import load_api_client

    console = Console()
    try:
        api_client = load_api_client(kubeconfig, context)
        rows = check_access(api_client, namespace)
    except Exception as error:  # noqa: BLE001 - unreachable, bad kubeconfig, refused: one line, exit 2
        console.print(f"[red]cannot check the cluster:[/red] {type(error).__name__}: {error}".splitlines()[0])
        raise typer.Exit(2) from None
    host = api_client.configuration.host
    table = Table(title=f"gpufleet cluster permissions at {host}")
    for column in ("", "verb", "resource", "namespace", "used for", "reason"):
        table.add_column(column)
    for row in rows:
        mark = "[green]ok[/green]" if row.allowed else "[red]MISSING[/red]"
        table.add_row(mark, row.verb, row.what, row.namespace or "(cluster)", row.purpose, row.reason)
    console.print(table)
    missing = [r for r in rows if not r.allowed]
    if missing:
        console.print(
            f"[red]{len(missing)} permission(s) missing[/red]: apply deploy/kubernetes/rbac.yaml "
            "(or bind these credentials to the gpufleet-control-plane roles)."
        )
        raise typer.Exit(1)
    console.print(f"[green]all {len(rows)} permissions granted[/green]")
