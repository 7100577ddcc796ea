"""``gpufleet node-gateway``: the only door from a GPU node to Temporal.

The entry point (``python -m workers.node_gateway``, as deploy/kubernetes/node-gateway.yaml
and ``gpufleet dev`` start it): its options, then the gateway of ``workers/gateway/``
(proxy, authorization, liveness, PKI; the package's docstring explains the design).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

import typer

from fleet.settings import Settings
from workers.gateway.pki import dev_gateway_files
from workers.gateway.proxy import GatewayCollector, start_gateway

log = logging.getLogger("gpufleet.node_gateway")


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpufleet node-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default=os.environ.get("GPUFLEET_GATEWAY_LISTEN", "127.0.0.1:7300"),
                        help="host:port for node agents")
    parser.add_argument("--cert", help="the gateway's server certificate (PEM)")
    parser.add_argument("--key", help="its private key (PEM)")
    parser.add_argument("--client-ca", help="CA that signs node client certificates (the cluster CA)")
    parser.add_argument("--dev", action="store_true", help="make/load a dev CA and certificate under the state dir")
    parser.add_argument("--live-ttl", type=float, default=1.0, help="seconds a node's liveness verdict is kept")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve /metrics here (default: GPUFLEET_METRICS_PORT; unset: none)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node-gateway %(levelname)s %(message)s")
    settings = Settings.from_env()
    if args.dev:
        files = dev_gateway_files(settings.state_dir)
        args.cert, args.key, args.client_ca = files["cert"], files["key"], files["ca"]
    if not (args.cert and args.key and args.client_ca):
        parser.error("--cert, --key and --client-ca are required (or --dev)")
    host, _, port = args.listen.rpartition(":")
    running = await start_gateway(settings, Path(args.cert).read_bytes(), Path(args.key).read_bytes(),
                                  Path(args.client_ca).read_bytes(), host=host or "127.0.0.1", port=int(port),
                                  live_ttl=args.live_ttl)
    log.info("node gateway on %s:%s → %s (namespace %s)", host, running.port, settings.address, settings.namespace)
    from prometheus_client import REGISTRY

    from workers.metrics import start_metrics

    metrics = start_metrics(args.metrics_port, "node-gateway")
    if metrics is not None:
        REGISTRY.register(GatewayCollector(running.gateway))
    from workers.gc_tuning import settle_garbage_collection

    settle_garbage_collection()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop()


def serve(argv: list[str] | None = None) -> None:
    """Run ``main`` on uvloop when it is installed: every forwarded call is a handful of event
    loop callbacks on the gateway's one thread, and uvloop's are cheaper."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(argv))
    else:
        uvloop.run(main(argv))


def cli(ctx: typer.Context) -> None:
    """The node gateway between GPU nodes and Temporal (``--help`` for its options)."""
    serve(ctx.args)


if __name__ == "__main__":
    serve()
