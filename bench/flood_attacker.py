"""One hostile node, in a process of its own (``bench.gateway``'s flood part and
tests/security/test_gateway_flood.py run it): on ``on`` (a line on stdin) it holds ``--polls``
long polls on its own queue open through the node gateway (each re-sent a second after it
ends, or a minute after it was sent), over as many connections as that takes, and keeps ``--big`` polls of ``--big-bytes``
each in flight the same way; on ``off`` it cancels them all (its connections stay open).

    python -m bench.flood_attacker ADDRESS CA CERT KEY NODE [--polls 1300] [--big 40]

It answers ``holding`` once every call is started (at once when they are) and ``quiet`` once
every call is gone.
Each call is re-sent a second after it ends rather than at once, and one the gateway refused
at once (beyond what it holds of a node) when a held one would have ended: the attack is the
holding (the frontend's poll budget, the gateway's memory), not a flood of calls over two
shared cores (calls refused at once load any server as fast as a node sends them).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys

import grpc
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import PollActivityTaskQueueRequest

SERVICE = "/temporal.api.workflowservice.v1.WorkflowService/"
#: Calls per connection: under the gateway's 32 streams, so every call is on the wire at once.
PER_CONNECTION = 30
#: The gateway's longest hold (``proxy.HOLD_SECONDS``): each call is sent at most this often.
RESEND_SECONDS = 60.0


async def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("address", "ca", "cert", "key", "node"):
        parser.add_argument(name)
    parser.add_argument("--polls", type=int, default=1300)
    parser.add_argument("--big", type=int, default=40)
    parser.add_argument("--big-bytes", type=int, default=3_000_000)
    args = parser.parse_args()
    tls = grpc.ssl_channel_credentials(open(args.ca, "rb").read(), open(args.key, "rb").read(),
                                       open(args.cert, "rb").read())
    total = args.polls + args.big
    channels = [grpc.aio.secure_channel(args.address, tls, options=[
        ("grpc.ssl_target_name_override", "localhost"), ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_send_message_length", 64 * 1024 * 1024)]) for _ in range(-(-total // PER_CONNECTION))]
    polls = [c.unary_unary(SERVICE + "PollActivityTaskQueue", request_serializer=None, response_deserializer=None)
             for c in channels]
    queue = TaskQueue(name=f"node/{args.node}")
    small = PollActivityTaskQueueRequest(namespace="default", task_queue=queue, identity=args.node).SerializeToString()
    big = PollActivityTaskQueueRequest(namespace="default", task_queue=queue,
                                       identity="x" * args.big_bytes).SerializeToString()
    ended: collections.Counter = collections.Counter()

    async def hold(i: int, request: bytes) -> None:
        poll = polls[i // PER_CONNECTION]
        loop = asyncio.get_running_loop()
        while True:
            sent = loop.time()
            try:
                await poll(request, timeout=70)
                ended["OK"] += 1
            except grpc.aio.AioRpcError as error:
                ended[error.code().name] += 1
            await asyncio.sleep(max(1.0, sent + RESEND_SECONDS - loop.time()))

    tasks: list[asyncio.Task] = []
    loop = asyncio.get_running_loop()
    while command := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        if command == "on":
            # Already on (two attacked batches in a row): the calls it holds stay held.
            if not tasks:
                tasks = [asyncio.create_task(hold(i, small if i < args.polls else big)) for i in range(total)]
                await asyncio.sleep(0)
            print("holding", flush=True)
        elif command == "off":
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tasks = []
            print("quiet", dict(ended), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
