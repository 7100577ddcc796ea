"""``gpufleet evacuate ...``: a provider incident by hand (SiteEvacuation), and its two endings.

``start`` runs the runbook at a site and follows it to the end; the command owns it, so leaving
early (Ctrl-C, SIGTERM, an error) aborts it, which puts back what it changed. ``abort`` and
``recovered`` end the evacuation running at a site, whoever started it (the Site entity's
incident rule, or a person); ``retry`` has it look again now for a place for the replicas.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, NoReturn, Optional, TypeVar

import typer
from rich.markup import escape

from cli.common import Address, ConfigPath, StateDir, console, err, fleet_client, run
from cli.common import settings as _settings

evacuate_app = typer.Typer(help="Evacuate a site by hand (a provider incident's runbook), abort it, end it, or have it look again.",
                           no_args_is_help=True)

Site = Annotated[str, typer.Argument(help="site (as in sites.yaml)")]
T = TypeVar("T")


def _fleet(address: str, state_dir: Path, config: str | None, site: str):
    """The client, once the site is known to the config (refused, exit 2, naming it otherwise)."""
    fleet = fleet_client(_settings(address, state_dir, config))
    known = fleet.config()
    if known is not None and site not in {s.name for s in known.sites}:
        err.print(f"[red]error:[/] site: unknown site {escape(site)!r}; known: "
                  f"{', '.join(s.name for s in known.sites)}")
        raise typer.Exit(2)
    return fleet


def _ask(address: str, state_dir: Path, config: str | None, site: str, update: Callable[[Any], Awaitable[T]]) -> T:
    """The answer to one update of the evacuation running at ``site``; a refusal exits 2 when the
    arguments are wrong, 1 when there is no evacuation or it will not."""
    from client import InvalidArgument, NotFound, Rejected

    fleet = _fleet(address, state_dir, config, site)
    try:
        return run(update(fleet))
    except InvalidArgument as error:
        _refused(error, 2)
    except (NotFound, Rejected) as error:
        _refused(error, 1)


def _refused(error: Exception, code: int) -> NoReturn:
    err.print(f"[red]refused:[/] {escape(str(error))}")
    raise typer.Exit(code)


@evacuate_app.command("start")
def start(
    site: Site,
    reason: Annotated[str, typer.Option(help="why (shown on its timeline and in the UI)")] = "evacuated by hand",
    request: Annotated[Optional[str], typer.Option(help="request id (default: random; the same id attaches)")] = None,
    detach: Annotated[bool, typer.Option(
        "--detach", help="start it and return: it runs on (end it with `gpufleet evacuate abort` or `recovered`); "
                         "without it, a command that ends before the evacuation aborts it")] = False,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Evacuate a site: weight 0, replicas elsewhere, drain, wait for recovery, restore.

    Shows each change until it ends (exit 0 restored, 1 aborted or failed). Interrupted (Ctrl-C,
    SIGTERM, a closed terminal), it aborts the evacuation, which puts back what it changed."""
    from client import InvalidArgument

    fleet = _fleet(address, state_dir, config, site)
    try:
        code = run(_start(fleet, {"site": site, "reason": reason}, request or uuid.uuid4().hex[:8], detach))
    except InvalidArgument as error:
        err.print(f"[red]error:[/] {escape('; '.join(f'{f}: {m}' for f, m in error.problems))}")
        raise typer.Exit(2) from None
    raise typer.Exit(code)


async def _start(fleet, raw: dict, request: str, detach: bool) -> int:
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import CancelledError

    from cli.common import failure
    from cli.requests import abort_evacuation, announce, detached, evacuation_summary, owned

    from client import InvalidArgument, manual_evacuation_id

    site = raw["site"]
    running = await fleet.running_evacuation(site)
    if running is not None and running != manual_evacuation_id(site, request):
        # Two runbooks at one site would each undo the other's changes when it ends.
        err.print(f"[red]refused:[/] site: {escape(running)} is already evacuating {escape(site)}; "
                  f"`gpufleet evacuate abort {escape(site)}` or `gpufleet evacuate recovered {escape(site)}` ends it")
        return 1
    if detach:
        handle = await fleet.evacuate_site(raw, request_id=request)
        announce(fleet.settings, handle.id)
        detached(handle.id, f"temporal workflow query --workflow-id {handle.id} --type progress",
                 f"gpufleet evacuate abort {site}   (puts back what it changed), or "
                 f"gpufleet evacuate recovered {site}   (the provider is back: restore)")
        return 0

    async def start_and_watch():
        try:
            handle = await fleet.evacuate_site(raw, request_id=request)
        except InvalidArgument as error:  # refused before anything started: nothing to abort
            err.print(f"[red]error:[/] {escape('; '.join(f'{f}: {m}' for f, m in error.problems))}")
            return 2
        announce(fleet.settings, handle.id)
        return await _watch(fleet, handle)

    # Owned from just before the start call: a Ctrl-C while it is in flight (the server may have
    # started the evacuation already) aborts it too, so it puts back what it changed.
    workflow_id = manual_evacuation_id(site, request)
    try:
        result = await owned(start_and_watch, lambda why: abort_evacuation(fleet, workflow_id, site, why),
                             "gpufleet evacuate start", ended=(WorkflowFailureError,))
    except WorkflowFailureError as error:
        if isinstance(error.cause, CancelledError):  # cancelled elsewhere (the UI, `temporal`): as an abort
            err.print(evacuation_summary(workflow_id, await fleet.evacuation_progress(workflow_id)),
                      markup=False, highlight=False)
            return 1
        err.print(f"[red]{workflow_id} failed:[/] {escape(failure(error)[1])}")
        return 1
    if isinstance(result, int):  # interrupted (aborted), or refused at start
        return result
    p = await fleet.evacuation_progress(workflow_id)
    console.print(evacuation_summary(workflow_id, p), markup=False, highlight=False)
    return 0 if result.outcome == "restored" else 1


def evacuation_line(workflow_id: str, p) -> str:
    """One line that says where the evacuation is, and while it waits, for what."""
    line = f"{workflow_id}: {p.state}, {p.step}"
    last = p.timeline[-1] if p.timeline else None
    if p.step_detail:
        line += f" ({p.step_detail})"
    elif last is not None and last.detail and last.name == p.step:
        line += f" ({last.detail})"
    if p.drained:
        line += f"; {len(p.drained)} node(s) drained"
    if p.capacity_request:
        line += f"; buying through {p.capacity_request}"
    if p.needs_person:
        line += f"; needs a person: {p.needs_person}"
    if p.state == "waiting-for-recovery":
        line += (f"; waiting for the provider: probes until it answers and every node is back, "
                 f"or `gpufleet evacuate recovered {p.site}`")
    return line


async def _watch(fleet, handle):
    """Until the evacuation ends: a live line on a terminal, one line per change when piped."""
    from cli.requests import watch_until_done

    return await watch_until_done(handle, lambda: fleet.evacuation_progress(handle.id),
                                  lambda p: evacuation_line(handle.id, p))


@evacuate_app.command("abort")
def abort(
    site: Site,
    reason: Annotated[str, typer.Option(help="why (shown on its timeline)")] = "aborted by an operator",
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Abort the evacuation running at a site: it puts back what it changed.

    Nodes it cordoned are uncordoned (unless held for a reason of their own, which it names),
    routing weights and Deployments go back as they were, what it bought or added elsewhere goes."""
    p = _ask(address, state_dir, config, site, lambda fleet: fleet.abort_evacuation(site, reason))
    console.print(f"aborting the evacuation of {site} (was {p.state}, {p.step}): it puts back what it changed; "
                  "its state goes restoring, then aborted", markup=False, highlight=False)


@evacuate_app.command("recovered")
def recovered(
    site: Site,
    note: Annotated[str, typer.Option(help="what the provider said (shown on its timeline)")] = "",
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Declare the site recovered: the evacuation restores now (each node still passes a smoke test first;
    one that fails stays cordoned and goes to its repair, or waits for a person where its node agent cannot run
    its compute check; unless enough fail to trip an incident)."""
    p = _ask(address, state_dir, config, site,
             lambda fleet: fleet.declare_site_recovered(site, note or "declared recovered by an operator"))
    console.print(f"{site} declared recovered (was {p.state}, {p.step}): smoke tests, then the weight climbs back",
                  markup=False, highlight=False)


@evacuate_app.command("retry")
def retry(
    site: Site,
    address: Address = "localhost:7233",
    state_dir: StateDir = Path(".gpufleet"),
    config: ConfigPath = None,
) -> None:
    """Look again now for a place for the site's replicas (after adding capacity or a compliant site)."""
    answer = _ask(address, state_dir, config, site, lambda fleet: fleet.retry_evacuation(site))
    console.print(f"{site}: {answer}", markup=False, highlight=False)
