"""A node gateway that checks nothing, in a process of its own: ``bench.gateway``'s baseline for
what the gateway itself costs. Mutual TLS from the node as the gateway terminates it, then every
call forwarded to the Temporal frontend as bytes, unread: no certificate shape, no liveness, no
limits, no rebuilt request. What a round trip through it adds over a direct one is the floor any
Python gRPC proxy pays (docs/benchmarks.md, "The node gateway's cost").

    python -m bench.passthrough LISTEN UPSTREAM CERT KEY CLIENT_CA

Prints ``ready`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

from workers.gateway.authorization import FORWARDED_METADATA


class Forward(grpc.GenericRpcHandler):
    def __init__(self, upstream: grpc.aio.Channel) -> None:
        self.upstream = upstream
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method not in self.handlers:  # one per method, as the gateway makes its own
            stub = self.upstream.unary_unary(method, request_serializer=None, response_deserializer=None)

            async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                metadata = tuple(m for m in context.invocation_metadata() or () if m[0] in FORWARDED_METADATA)
                remaining = context.time_remaining()
                try:
                    return await stub(request, metadata=metadata,
                                      timeout=remaining if remaining and remaining < 1e6 else None)
                except grpc.aio.AioRpcError as error:
                    context.set_trailing_metadata(tuple(error.trailing_metadata() or ()))
                    await context.abort(error.code(), error.details() or "")

            self.handlers[method] = grpc.unary_unary_rpc_method_handler(forward)
        return self.handlers[method]


async def main(args: argparse.Namespace) -> None:
    read = lambda path: open(path, "rb").read()  # noqa: E731
    upstream = grpc.aio.insecure_channel(args.upstream)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Forward(upstream),))
    credentials = grpc.ssl_server_credentials([(read(args.key), read(args.cert))],
                                              root_certificates=read(args.client_ca), require_client_auth=True)
    server.add_secure_port(args.listen, credentials)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("listen", "upstream", "cert", "key", "client_ca"):
        parser.add_argument(name)
    options = parser.parse_args()
    try:  # the gateway runs on uvloop when it is installed: so does its baseline
        import uvloop
    except ImportError:
        asyncio.run(main(options))
    else:
        uvloop.run(main(options))
