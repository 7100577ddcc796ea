"""``gpufleet weights pull``: the serving pod's init step, by hand."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

weights_app = typer.Typer(no_args_is_help=True)


@weights_app.callback()
def weights() -> None:
    """Model weights on this node: copy from the site's object store and verify."""


@weights_app.command("pull")
def pull(
    spec: Annotated[Optional[str], typer.Argument(
        help="WeightsPull JSON (model, version, store, prefix, files with sha256); '-' for stdin; "
             "default: $GPUFLEET_WEIGHTS")] = None,
    cache: Annotated[str, typer.Option(help="node-local cache root shared by the node's replicas")] =
        "/var/cache/gpufleet/models",
    bandwidth: Annotated[int, typer.Option(help="bytes/s cap, 0 for none")] = 0,
) -> None:
    """Copy one model version into the node-local cache, verifying every file's sha256
    against the manifest; exits 2 naming the file on any mismatch (the server must not start)."""
    from workers.weights_pull import run

    raise typer.Exit(run(spec, cache, bandwidth))
