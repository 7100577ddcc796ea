"""``gpufleet node-gateway``: the only door from a GPU node to Temporal.

The entry point (``python -m workers.node_gateway``, as deploy/kubernetes/node-gateway.yaml
and ``gpufleet dev`` start it): its options, then the gateway of ``workers/gateway/``
(proxy, authorization, liveness, PKI; the package's docstring explains the design).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from fleet.settings import NodeGatewayEnv, Settings, SettingsError

log = logging.getLogger("gpufleet.node_gateway")


@dataclass
class GatewayOptions:
    listen: str
    cert: str | None
    key: str | None
    client_ca: str | None
    dev: bool
    live_ttl: float
    metrics_port: int | None


async def main(args: GatewayOptions) -> None:
    # grpc and cryptography load here, not when the ``gpufleet`` CLI imports this module.
    from workers.gateway.peers import dns_peers
    from workers.gateway.pki import dev_gateway_files
    from workers.gateway.proxy import GatewayCollector, start_gateway
    from workers.gateway.task_tokens import TokenKeys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s node-gateway %(levelname)s %(message)s")
    settings = Settings.from_env()
    try:
        rates = NodeGatewayEnv.from_env()
    except SettingsError as error:
        raise SystemExit(str(error)) from None
    token_keys = rates.token_keys
    if args.dev:
        files = dev_gateway_files(settings.state_dir)
        args.cert, args.key, args.client_ca = files["cert"], files["key"], files["ca"]
        token_keys = token_keys or files["token_keys"]
    if not (args.cert and args.key and args.client_ca):
        raise SystemExit("--cert, --key and --client-ca are required (or --dev)")
    try:
        keys = TokenKeys.load(token_keys)
    except SettingsError as error:
        raise SystemExit(str(error)) from None
    host, _, port = args.listen.rpartition(":")
    running = await start_gateway(settings, Path(args.cert).read_bytes(), Path(args.key).read_bytes(),
                                  Path(args.client_ca).read_bytes(), keys, host=host or "127.0.0.1", port=int(port),
                                  live_ttl=args.live_ttl, calls_per_second=rates.calls_per_second,
                                  call_burst=rates.call_burst,
                                  upstream_calls_per_second=rates.replica_upstream_calls_per_second,
                                  peers=dns_peers(rates.peers) if rates.peers else None,
                                  peer_port=int(rates.peers.rpartition(":")[2]) if rates.peers else 0)
    log.info("node gateway on %s:%s → %s (namespace %s); upstream at most %g calls a second, its part of %g "
             "for %d replicas", host, running.port, settings.address, settings.namespace,
             rates.replica_upstream_calls_per_second, rates.upstream_calls_per_second, rates.replicas)
    log.info("task tokens bound to their node with the key in %s (%s)", token_keys,
             "and the previous one accepted" if keys.previous else "no previous key")
    from prometheus_client import REGISTRY

    from workers.metrics import start_metrics

    metrics = start_metrics(args.metrics_port, "node-gateway")
    if metrics is not None:
        REGISTRY.register(GatewayCollector(running.gateway, running.peer_usage))
    from workers.gc_tuning import settle_garbage_collection

    settle_garbage_collection()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop()


def serve(args: GatewayOptions) -> None:
    """Run ``main`` on uvloop when it is installed: every forwarded call is a handful of event
    loop callbacks on the gateway's one thread, and uvloop's are cheaper."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(args))
    else:
        uvloop.run(main(args))


def cli(
    listen: Annotated[str, typer.Option(envvar=NodeGatewayEnv.variable("listen"), help="host:port for node agents")]
    = NodeGatewayEnv.model_fields["listen"].default,
    cert: Annotated[Optional[str], typer.Option(help="the gateway's server certificate (PEM)")] = None,
    key: Annotated[Optional[str], typer.Option(help="its private key (PEM)")] = None,
    client_ca: Annotated[Optional[str], typer.Option(
        help="CA that signs node client certificates (the cluster CA)")] = None,
    dev: Annotated[bool, typer.Option("--dev", help="make/load a dev CA and certificate under the state dir")] = False,
    live_ttl: Annotated[float, typer.Option(help="seconds a node's liveness verdict is kept")] = 1.0,
    metrics_port: Annotated[Optional[int], typer.Option(min=1, max=65535,
        help="serve /metrics here (default: GPUFLEET_METRICS_PORT; unset: none)")] = None,
) -> None:
    """Run the node gateway: mutual TLS in front of Temporal, the only door from a GPU node to it."""
    if not dev and not (cert and key and client_ca):
        raise typer.BadParameter("--cert, --key and --client-ca are required (or --dev)", param_hint="--cert")
    serve(GatewayOptions(listen, cert, key, client_ca, dev, live_ttl, metrics_port))


if __name__ == "__main__":
    typer.run(cli)
