"""What every command that starts a workflow does with it.

It names the workflow and its Temporal UI link (``announce``). A command that waits for what
it started owns it: exiting early (Ctrl-C, SIGTERM, SIGHUP, an error) stops it, and Ctrl-C
says what that stopped. ``--detach`` returns at once instead and leaves it running, saying how
to follow and stop it (``detached``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import quote

from rich.markup import escape

from cli.common import console, err
from fleet.settings import CliEnv, Settings

T = TypeVar("T")

#: Exit code of a command stopped by Ctrl-C (SIGINT), as a shell reports it.
INTERRUPTED = 130
#: The Temporal UI's base URL (e.g. ``https://temporal.example.com``); unset: derived from the
#: frontend address (``ui_base``); ``none``: there is no UI, so no link is printed. ``gpufleet
#: dev`` sets it for its children and prints it for other shells (its ``--ui-port``, or ``none``
#: with ``--temporal cluster``, which runs no UI).
UI_URL_ENV = CliEnv.variable("ui_url")
NO_UI = "none"


# -- the Temporal UI --------------------------------------------------------------------------
def ui_base(address: str) -> str:
    """The UI beside a frontend: Temporal Cloud's for a ``*.tmprl.cloud`` address, else the
    frontend's host at its port + 1000, where ``temporal server start-dev`` (and so
    ``gpufleet dev``, 7233 → 8233) serves it by default."""
    host, _, port = address.rpartition(":")
    host = host or "localhost"
    if host.endswith(".tmprl.cloud"):
        return "https://cloud.temporal.io"
    try:
        return f"http://{host}:{int(port) + 1000}"
    except ValueError:
        return f"http://{address}"


def ui_link(settings: Settings, workflow_id: str) -> str | None:
    """The Temporal UI page of a workflow (its latest run): ``<ui>/namespaces/<ns>/workflows/<id>``,
    the id one path segment (``join/site/x`` → ``join%2Fsite%2Fx``); None where there is no UI."""
    base = CliEnv.get("ui_url") or ui_base(settings.address)
    if base.lower() == NO_UI:
        return None
    return f"{base.rstrip('/')}/namespaces/{quote(settings.namespace, safe='')}/workflows/{quote(workflow_id, safe='')}"


def announce(settings: Settings, workflow_id: str, what: str = "started") -> None:
    """``started <id>`` and, on its own line, the workflow's UI link (never wrapped: it stays clickable)."""
    console.print(f"{what} [bold]{escape(workflow_id)}[/]")
    link = ui_link(settings, workflow_id)
    if link is not None:
        console.print(f"  UI: {link}", markup=False, highlight=False, soft_wrap=True)


def detached(workflow_id: str, follow: str, stop: str) -> None:
    """What ``--detach`` prints: the request runs on, and how to follow and stop it."""
    console.print(f"detached: {escape(workflow_id)} runs on until it ends", highlight=False)
    console.print(f"  follow: {follow}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  stop:   {stop}", markup=False, highlight=False, soft_wrap=True)


# -- owning what was started ------------------------------------------------------------------
@contextlib.contextmanager
def cancel_on_exit_signals():
    """SIGTERM and SIGHUP (a closed terminal) end the command like Ctrl-C does: the running
    task is cancelled, so the command's own clean-up runs."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    added = []
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            loop.add_signal_handler(sig, task.cancel)
            added.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such signal
            pass
    try:
        yield
    finally:
        for sig in added:
            loop.remove_signal_handler(sig)


async def owned(watch: Callable[[], Awaitable[T]], cancel: Callable[[str], Awaitable[int]], command: str,
                ended: tuple[type[BaseException], ...] = ()) -> T | int:
    """``watch()``'s result; a request nobody waits for any more is stopped. Interrupted (Ctrl-C,
    SIGTERM, SIGHUP): ``cancel(reason)``, whose exit code is returned. Failed with anything but
    ``ended`` (the request's own end, e.g. ``WorkflowFailureError``): cancelled, then re-raised."""
    with cancel_on_exit_signals():
        try:
            return await watch()
        except asyncio.CancelledError:  # the request must not outlive us
            asyncio.current_task().uncancel()
            return await cancel(f"the `{command}` that started it was interrupted")
        except ended:
            raise
        except Exception:
            with contextlib.suppress(Exception):
                await cancel(f"the `{command}` that started it failed")
            raise


async def answer_or_leave(what: Awaitable[T], seconds: float, still: str) -> T | None:
    """``what``'s answer within ``seconds``; None (having said ``still``) when it takes longer.
    A second Ctrl-C leaves too: the request has the cancel by then and carries it out. The
    client's own time-outs are raised, not said as ``still``: an ``UpdateNotTaken`` (a
    ``TimeoutError`` too) means no worker took the cancel, so it was not taken at all."""
    from client import FleetClientError

    try:
        async with asyncio.timeout(seconds):
            return await what
    except TimeoutError as error:
        if isinstance(error, FleetClientError):
            raise
        err.print(still)
        return None


# -- the three kinds of request ---------------------------------------------------------------
async def cancel_capacity(fleet, workflow_id: str, reason: str) -> int:
    """Cancel a capacity request and say what that stopped."""
    from client import NotFound, Rejected

    err.print(f"cancelling {workflow_id} (its joins in flight delete their machines) ...")
    try:
        p = await answer_or_leave(fleet.cancel_capacity(
            workflow_id, reason, accepted=lambda: err.print("  taken; waiting for the joins to stop "
                                                            "(Ctrl-C again leaves, the cancel goes on)")), 300,
            f"{workflow_id}: cancel taken; the joins are still stopping "
            f"(`temporal workflow describe --workflow-id {workflow_id}` shows them)")
    except (Rejected, NotFound) as error:  # it ended meanwhile: nothing left to stop
        err.print(f"{workflow_id}: nothing to cancel ({error})")
        return INTERRUPTED
    if p is not None:
        err.print(cancel_summary(workflow_id, p))
    return INTERRUPTED


def cancel_summary(workflow_id: str, p) -> str:
    """What a capacity request's cancel stopped (its ``CapacityProgress``)."""
    stopped = f"{len(p.released)} joins stopped, their machines deleted" if p.released else "no join was in flight"
    kept = f"{p.joined} joined node(s) stay" if p.joined else "nothing joined"
    text = f"cancelled {workflow_id}: {stopped}; {kept}"
    return text + "".join(f"\n  stopped {r}" for r in p.released)


async def cancel_joins(fleet, workflow_ids: list[str], reason: str) -> int:
    """Cancel joins (each deletes a machine it bought and has not admitted) and say, per join,
    what that stopped."""
    if not workflow_ids:
        return INTERRUPTED
    err.print(f"cancelling {', '.join(workflow_ids)} (a machine bought and not yet admitted is deleted) ...")

    from client import NotFound

    async def one(workflow_id: str) -> str:
        try:
            return (await fleet.cancel_join(workflow_id, reason)).summary()
        except NotFound:
            return f"{workflow_id}: never started: nothing to cancel"
        except Exception as error:  # noqa: BLE001 - one join's answer must not hide the others'
            return f"{workflow_id}: cancel requested; no answer ({type(error).__name__}: {error})"

    lines = await answer_or_leave(asyncio.gather(*(one(w) for w in workflow_ids)), 300,
                                  "cancel requested; the joins are still cleaning up "
                                  "(`temporal workflow describe --workflow-id <id>` shows each)")
    for line in lines or []:
        err.print(line, markup=False, highlight=False)
    return INTERRUPTED


async def abort_evacuation(fleet, workflow_id: str, site: str, reason: str) -> int:
    """Abort an evacuation (it puts back what it changed) and say what it put back."""
    from client import NotFound, Rejected

    err.print(f"aborting {workflow_id} (it puts back what it changed: nodes uncordoned, routing weights restored) ...")
    try:
        await fleet.abort_evacuation(site, reason, evacuation_id=workflow_id)
    except (Rejected, NotFound) as error:  # it ended meanwhile: nothing left to stop
        err.print(f"{workflow_id}: nothing to abort ({error})")
        return INTERRUPTED
    result = await answer_or_leave(_evacuation_end(fleet, workflow_id), 300,
                                   f"{workflow_id}: abort taken; still restoring "
                                   f"(`gpufleet evacuate abort {site}` again is harmless; the UI shows it)")
    if result is not None:
        err.print(evacuation_summary(workflow_id, result), markup=False, highlight=False)
    return INTERRUPTED


async def _evacuation_end(fleet, workflow_id: str):
    """The evacuation's last progress once it has ended (any way)."""
    client = await fleet.temporal()
    with contextlib.suppress(Exception):  # aborted, failed or cancelled: the progress says what it put back
        await client.get_workflow_handle(workflow_id).result()
    return await fleet.evacuation_progress(workflow_id)


def evacuation_summary(workflow_id: str, p) -> str:
    """How an evacuation ended (its ``EvacuationProgress``)."""
    text = f"{p.state} {workflow_id}"
    if p.state in ("aborted", "cancelled"):  # a cancel puts back what it changed, as an abort does
        uncordoned = [node for node in p.drained if node not in p.held]
        text += f": {len(uncordoned)} drained node(s) uncordoned, routing weights as before"
    text += "".join(f"\n  stays cordoned: {node}: {why}" for node, why in sorted(p.held.items()))
    if p.needs_person:
        text += f"\n  needs a person: {p.needs_person}"
    return text


async def watch_until_done(handle, progress: Callable[[], Awaitable[object]], line: Callable[[object], str],
                           render: Callable[[object, str], object] | None = None):
    """Until ``handle``'s workflow ends, its result: on a terminal a live line (or ``render``'s
    view of the progress and its line), piped one line per change. ``progress`` may fail
    before the workflow's first task has run; the watch then waits for the next look. While no
    worker answers, the view says so (``UnansweredQueries``) and the watch goes on asking."""
    from rich.live import Live
    from rich.text import Text

    from cli.waits import UnansweredQueries

    result_task = asyncio.ensure_future(handle.result())
    live = Live(console=console, refresh_per_second=4) if console.is_terminal else None
    unanswered = UnansweredQueries()
    last, view = "", None
    try:
        if live is not None:
            live.start()
        while not result_task.done():
            try:
                p = await unanswered.ask(progress)
            except Exception:  # noqa: BLE001 - the first task may not have run yet
                p = None
            if p is not None:
                now = line(p)
                view = render(p, now) if render is not None else Text(now)
                if live is None and now != last:
                    print(now, flush=True)
                last = now
            if live is not None:
                live.update(unanswered.beneath(view))
            elif (news := unanswered.news()) is not None:
                print(news, flush=True)
            await asyncio.wait([result_task], timeout=0.5)
        return result_task.result()
    finally:
        if live is not None:
            live.stop()
        if not result_task.done():
            result_task.cancel()
