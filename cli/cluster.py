"""``gpufleet cluster ...``: commands about the Kubernetes cluster itself."""

from __future__ import annotations

import shlex
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fleet.settings import CONFIG_ENV

cluster_app = typer.Typer(no_args_is_help=True)

#: What deploy/kubernetes/node-agent.yaml reads: ``endpoint`` and ``ca.crt``.
NODE_GATEWAY_CONFIGMAP = "gpufleet-node-gateway"


@cluster_app.callback()
def cluster() -> None:
    """The Kubernetes cluster gpufleet runs (real mode)."""


@cluster_app.command("check")
def check(
    kubeconfig: str = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG",
                                   help="kubeconfig file(s), ':'-separated (default: in-cluster, then ~/.kube/config)"),
    context: str = typer.Option(None, "--context", help="kubeconfig context"),
    namespace: str = typer.Option("gpufleet", "--namespace", "-n", help="namespace of serving and routing objects"),
    tunnels: bool = typer.Option(True, "--tunnels/--no-tunnels",
                                 help="also check the Konnectivity tunnels (skip only when every GPU node "
                                      "shares the control plane's network)"),
    config: str = typer.Option(None, "--config", envvar=CONFIG_ENV,
                               help="fleet config (sites.yaml): also check that the control plane may get "
                                    "each Secret it names"),
) -> None:
    """Check that these credentials may do everything the cluster adapter does, that what
    they (and a node's certificate) can reach beyond that is fenced (kubeadm's auto-approve
    bindings removed, the admission policies on the control plane's Secrets, on a node's own
    marks and on its own pods enforced), that the API server can reach every gpufleet node's
    kubelet (Konnectivity), and, given the fleet config, that the control plane's service
    account may get each Secret it names (the Role ``gpufleet cluster credentials-role``
    renders). That last needs credentials that may create SubjectAccessReviews, or the service
    account's own; with neither it is a warning.

    Exit 0 when every permission is granted, the fences stand and the tunnels run, 1 when
    anything is missing or a kubeadm auto-approve binding is present, 2 when the cluster
    cannot be asked or the config cannot be read.
    """
    from fleet.config import ConfigError, load_config
    from providers.cluster.check import check_access, check_credentials_access, check_hardening, check_tunnels
    from providers.cluster.kubernetes import load_api_client
    from providers.cluster.kubernetes.api import unanswered
    from providers.credentials import CONTROL_PLANE_ACCOUNT, CREDENTIALS_NAMESPACE, control_plane_secret_fields

    console = Console()
    secrets = None
    if config:  # before the cluster is asked anything: a config that cannot be read is the operator's to fix
        try:
            secrets = control_plane_secret_fields(load_config(config), config)
        except ConfigError as error:
            console.print(f"[red]cannot check the credentials the fleet config names:[/red] {escape(str(error))}")
            raise typer.Exit(2) from None
    try:
        api_client = load_api_client(kubeconfig, context)
    except Exception as error:  # noqa: BLE001 - a bad kubeconfig: one line, exit 2
        _cannot_check(console, error)
    try:
        rows = check_access(api_client, namespace)
        hardening = check_hardening(api_client)
        report = check_tunnels(api_client) if tunnels else None
        credentials = (check_credentials_access(api_client, secrets, CREDENTIALS_NAMESPACE, CONTROL_PLANE_ACCOUNT)
                       if secrets else None)
    except Exception as error:  # noqa: BLE001 - unreachable, refused: one line, exit 2
        # Never the client's own words for a request it could not send: they quote the request's
        # Authorization header (a token ending in a newline), or a proxied URL with its password.
        _cannot_check(console, unanswered(error, "ask the API server", api_client.configuration) or error)
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
    else:
        console.print(f"[green]all {len(rows)} permissions granted[/green]")
    _print_hardening(console, hardening)
    if report is not None:
        _print_tunnels(console, report)
    unreadable = _print_credentials(console, config, secrets, credentials)
    if missing or any(not row.ok for row in hardening) or (report is not None and not report.ok) or unreadable:
        raise typer.Exit(1)


def _print_credentials(console: Console, config: str | None, secrets, access) -> bool:
    """The Secrets the fleet config names and whether the control plane may get each (never
    their contents: the check reads none). True when one may not be got."""
    if not config:
        console.print("[yellow]no fleet config given[/yellow] (--config or $GPUFLEET_CONFIG): whether the control "
                      "plane may get the Secrets it names is not checked")
        return False
    if not secrets:
        console.print(f"[green]{escape(config)} names no Secret[/green] for the control plane to get")
        return False
    if access.unasked:
        console.print(f"[yellow]WARNING: not checked whether {access.user} may get the {len(secrets)} Secret(s) "
                      f"{escape(config)} names[/yellow]: {escape(access.unasked)}; run the check again with "
                      "credentials that may (e.g. a cluster admin's) or with the service account's own")
        return False
    table = Table(title=f"may {access.user} get the Secrets {escape(config)} names?")
    reasons = any(row.reason for row in access.rows)
    for column in ("", "secret", "named by", *(("reason",) if reasons else ())):
        table.add_column(column)
    for row in access.rows:
        mark = "[green]ok[/green]" if row.allowed else "[red]MISSING[/red]"
        table.add_row(mark, f"gpufleet/{row.secret}", escape(", ".join(row.fields)),
                      *((escape(row.reason),) if reasons else ()))
    console.print(table)
    refused = [row for row in access.rows if not row.allowed]
    if refused:
        console.print(f"[red]{len(refused)} Secret(s) the control plane may not get[/red] (each call with one fails "
                      "with BadCredentials); render the credentials Role from this config and apply it: "
                      f"gpufleet cluster credentials-role --config {escape(shlex.quote(config))} | kubectl apply -f -")
    else:
        console.print(f"[green]the control plane may get all {len(access.rows)} Secret(s) "
                      f"{escape(config)} names[/green]")
    return bool(refused)


def _cannot_check(console: Console, error: Exception) -> NoReturn:
    console.print(f"[red]cannot check the cluster:[/red] {type(error).__name__}: {error}".splitlines()[0])
    raise typer.Exit(2) from None


def _print_hardening(console: Console, rows) -> None:
    from providers.cluster.check import KUBEADM_BINDINGS, remove_kubeadm_bindings_command

    table = Table(title="what the control plane's credential and a node's certificate can reach")
    for column in ("", "object", "state", "fix"):
        table.add_column(column)
    for row in rows:
        table.add_row("[green]ok[/green]" if row.ok else "[red]RISK[/red]", row.what, row.state, row.fix)
    console.print(table)
    present = [name for name in KUBEADM_BINDINGS if any(r.what.endswith(f" {name}") and r.fix for r in rows)]
    if present:
        # One line to copy: gpufleet's own approver judges its joins and renewals without them.
        console.print(f"[red]remove kubeadm's auto-approve bindings[/red]: {remove_kubeadm_bindings_command(present)}"
                      "  (kubeadm upgrade apply puts them back: check again after every upgrade)")
    if all(row.ok for row in rows):
        console.print("[green]kubeadm's auto-approve bindings absent, admission policies enforced[/green]")


def _print_tunnels(console: Console, report) -> None:
    table = Table(title="API server → kubelet tunnels (Konnectivity, kube-system)")
    for column in ("", "part", "state"):
        table.add_column(column)

    def row(ok: bool, part: str, state: str, wrong: str = "MISSING") -> None:
        table.add_row("[green]ok[/green]" if ok else f"[red]{wrong}[/red]", part, state)

    if report.error:
        row(False, "pods and nodes", f"cannot be read: {report.error}")
    else:
        row(bool(report.servers), "konnectivity-server", ", ".join(report.servers) or "none running")
        if report.servers:
            row(not report.miscounted, "--server-count", _server_count_state(report), wrong="WRONG")
        total = len(report.agents) + len(report.missing)
        shown = ", ".join(report.missing[:10]) + (f" and {len(report.missing) - 10} more" if len(report.missing) > 10
                                                   else "")
        row(not report.missing, "konnectivity-agent",
            f"on {len(report.agents)} of {total} gpufleet nodes" + (f"; none on {shown}" if report.missing else ""))
    console.print(table)
    if report.ok:
        console.print("[green]tunnels running[/green] (the API server's egress selector: README checklist)")
    elif report.error or not report.servers or report.missing:
        console.print("[red]tunnels missing[/red]: kubectl logs/exec/port-forward fail for nodes behind NAT; "
                      "apply deploy/network/konnectivity (deploy/network/README.md)")
    if report.miscounted:
        console.print(f"[red]server count wrong[/red]: set --server-count={len(report.servers)} in "
                      "/etc/kubernetes/manifests/konnectivity-server.yaml on every control-plane host")


def _server_count_state(report) -> str:
    """Each server tells its agents how many servers to hold a tunnel to: too few, and an agent
    stops dialling the load balancer before it reaches every host's server."""
    running = len(report.servers)
    if not report.miscounted:
        return f"each of the {running} running server(s) declares {running}"
    declared = ", ".join(f"{name} declares {count}" for name, count in report.server_counts.items())
    too_few = any(not count.isdigit() or int(count) < running for count in report.miscounted.values())
    harm = ("agents stop dialling once they hold that many servers, so kubectl logs/exec/port-forward fail "
            "through the API servers whose own server they missed" if too_few else
            "agents keep redialling for servers that do not run (harmless, noisy)")
    return f"{declared}; {running} running: {harm}"


@cluster_app.command("node-config")
def node_config(
    config: str = typer.Option(None, "--config", envvar=CONFIG_ENV, help="fleet config (sites.yaml)"),
    namespace: str = typer.Option("gpufleet", "--namespace", "-n", help="namespace of the node-agent DaemonSet"),
) -> None:
    """Print the ConfigMap the node-agent DaemonSet reads (where agents dial the node gateway),
    from ``node_gateway`` in the fleet config: ``gpufleet cluster node-config --config sites.yaml | kubectl apply -f -``.

    Exit 2 when the config has no usable ``node_gateway``.
    """
    import yaml

    from fleet.config import ConfigError, load_config
    from fleet.errors import BadCredentials
    from providers.credentials import read_secret

    err = Console(stderr=True)
    try:
        gateway = load_config(config).node_gateway
        if gateway is None:
            raise ConfigError(config or "(config)", ["node_gateway: missing (endpoint and ca)"])
        ca = read_secret(gateway.ca)
    except (ConfigError, BadCredentials) as error:
        err.print(f"[red]cannot render the node-gateway ConfigMap:[/red] {error}")
        raise typer.Exit(2) from None
    try:
        from cryptography import x509

        x509.load_pem_x509_certificates(ca.encode())
    except ValueError:
        err.print(f"[red]node_gateway.ca ({gateway.ca.describe()}) is not a PEM certificate[/red]")
        raise typer.Exit(2) from None
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NODE_GATEWAY_CONFIGMAP, "namespace": namespace,
                     "labels": {"app.kubernetes.io/part-of": "gpufleet"}},
        # server-name: what the agents check the gateway's certificate against (the endpoint's host).
        "data": {"endpoint": gateway.endpoint, "server-name": gateway.endpoint.rsplit(":", 1)[0].strip("[]"),
                 "ca.crt": ca.strip() + "\n"},
    }
    typer.echo(yaml.safe_dump(doc, sort_keys=False), nl=False)


@cluster_app.command("credentials-role")
def credentials_role(
    config: str = typer.Option(None, "--config", envvar=CONFIG_ENV,
                               help="the fleet config the control plane runs with (sites.yaml); required"),
) -> None:
    """Print the Role (and its RoleBinding) that lets the control plane get the Secrets the fleet
    config names, each by name, and no other Secret: ``gpufleet cluster credentials-role --config
    sites.yaml | kubectl apply -f -``. Run it again whenever sites.yaml names another Secret;
    applied over an older ``gpufleet-credentials`` Role, it replaces that Role's rules.

    Exit 2 when no config is given, the config cannot be read or it names a Secret outside
    ``gpufleet``.
    """
    import yaml

    from fleet.config import ConfigError, load_config
    from providers.credentials import credentials_role as render

    if not config:
        # Not the built-in simulated fleet, as other commands default to: it names no Secret, and
        # its Role, applied, would take every credential read from the real control plane.
        Console(stderr=True).print(f"[red]cannot render the credentials Role:[/red] name the fleet config the "
                                   f"control plane runs with (--config sites.yaml, or ${CONFIG_ENV})")
        raise typer.Exit(2)
    try:
        docs = render(load_config(config), config or "(config)")
    except ConfigError as error:
        Console(stderr=True).print(f"[red]cannot render the credentials Role:[/red] {escape(str(error))}")
        raise typer.Exit(2) from None
    typer.echo(yaml.safe_dump_all(docs, sort_keys=False), nl=False)
