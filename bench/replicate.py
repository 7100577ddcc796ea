"""Weights replication vs plain boto3, same files, same two moto stores, same run.

``Replicator`` (what the ``replicate_weights`` activity runs: sha256 while
streaming, checked against the manifest, ChecksumSHA256 on every upload for the
store to check, the skip-if-present check, heartbeat bookkeeping) against the
plain copy ``upload_fileobj(get_object()["Body"])`` (boto3's managed transfer) of
the same files. Both copy to two stores at once (a thread per store); the order
of the variants alternates from round to round; every round copies into fresh
destination buckets.

The baseline is given everything ours has: clients from the same factory
(``make_s3_client``: same botocore Config, pool size, checksum and signing
settings), built before the clock starts as the activity caches its clients, and
a TransferConfig with our part size, single-PUT threshold and part concurrency.
It is also run with boto3's defaults (``boto3.client("s3")``, default
TransferConfig) for reference. Medians over the rounds are compared.

    python -m bench.replicate [--files 8] [--mib 8] [--rounds 5]
    python -m bench.replicate --smoke   # 2 files of 1 MiB, 1 round (the suite runs this)

Note: moto accepts ChecksumSHA256 without checking it, as a store that checks
would; what is measured is our side's cost.
"""

from __future__ import annotations

import hashlib
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import typer

from activities.weights import ReplicateInput, Replicator, make_s3_client
from bench.common import Smoke, command_line, bench_args
from fleet.config import ObjectStore
from fleet.models import CredentialsRef
from fleet.rollout import Replication, WeightFile

MiB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _proc_cpu(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def store(endpoint: str) -> ObjectStore:
    return ObjectStore(endpoint_url=endpoint, bucket=f"b-{uuid.uuid4().hex[:10]}", addressing_style="path",
                       credentials=CredentialsRef(env="BENCH_S3_KEY"))


def main(
    files: Annotated[int, typer.Option()] = 8,
    mib: Annotated[int, typer.Option()] = 8,
    rounds: Annotated[int, typer.Option()] = 5,
    part_mib: Annotated[int, typer.Option()] = 8,
    concurrency: Annotated[int, typer.Option()] = 4,
    smoke: Smoke = False,
) -> None:
    args = bench_args(locals())
    if args.smoke:
        args.files, args.mib, args.rounds = 2, 1, 1
    os.environ["BENCH_S3_KEY"] = "bench:bench"
    servers = [start_moto(), start_moto()]
    try:
        import boto3
        from boto3.s3.transfer import TransferConfig

        endpoints = [e for _, e in servers]
        source = store(endpoints[0])
        src = make_s3_client(source)
        src.create_bucket(Bucket=source.bucket)
        files = []
        for i in range(args.files):
            data = os.urandom(args.mib * MiB)
            path = f"model-{i:05d}.safetensors"
            src.put_object(Bucket=source.bucket, Key=path, Body=data)
            files.append(WeightFile(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest()))
        total = sum(f.size for f in files) * len(endpoints)
        options = Replication(part_size_bytes=args.part_mib * MiB, chunk_size_bytes=1 * MiB,
                              concurrency=args.concurrency)
        pool = max(16, options.concurrency * 2)  # what the activity sizes its clients' pools to
        # Clients are built once, outside the timing, for every variant (the activity caches them).
        clients = {e: (make_s3_client(source, pool), make_s3_client(store(e), pool)) for e in endpoints}
        defaults = dict(aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1")
        default_clients = {e: (boto3.client("s3", endpoint_url=source.endpoint_url, **defaults),
                               boto3.client("s3", endpoint_url=e, **defaults)) for e in endpoints}
        # Same request shape as ours: one PUT up to the part size, parts of that size above it.
        same_transfer = TransferConfig(multipart_threshold=options.part_size_bytes + 1,
                                       multipart_chunksize=options.part_size_bytes,
                                       max_concurrency=options.concurrency)

        def fresh_bucket(endpoint: str) -> ObjectStore:
            dest = store(endpoint)
            clients[endpoint][1].create_bucket(Bucket=dest.bucket)
            return dest

        def ours(endpoint: str, dest: ObjectStore) -> None:
            s, d = clients[endpoint]
            result = Replicator(ReplicateInput(site="bench", source=source, files=files, dest_prefix="w/",
                                               options=options), dest, s, d).run()
            assert set(result.files.values()) == {"copied"}

        def plain_with(pair: dict, transfer: TransferConfig | None):
            def plain(endpoint: str, dest: ObjectStore) -> None:
                s, d = pair[endpoint]
                for f in files:
                    body = s.get_object(Bucket=source.bucket, Key=f.path)["Body"]
                    d.upload_fileobj(body, dest.bucket, f"w/{f.path}", Config=transfer)
            return plain

        variants = {"plain boto3 (same client config)": plain_with(clients, same_transfer),
                    "plain boto3 (boto3 defaults)": plain_with(default_clients, None),
                    "replicate (verify)": ours}

        def cpu() -> float:
            """CPU seconds of this process (every thread) and of the two stores."""
            usage = resource.getrusage(resource.RUSAGE_SELF)
            return usage.ru_utime + usage.ru_stime + sum(_proc_cpu(proc.pid) for proc, _ in servers)

        def timed(fn) -> tuple[float, float]:
            dests = [fresh_bucket(e) for e in endpoints]
            cpu0, start = cpu(), time.perf_counter()
            with ThreadPoolExecutor(len(endpoints)) as threads:
                list(threads.map(fn, endpoints, dests))
            return time.perf_counter() - start, cpu() - cpu0

        for fn in variants.values():
            timed(fn)  # warm-up: connections, first-call code paths
        times: dict[str, list[float]] = {name: [] for name in variants}
        cpus: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                wall, used = timed(variants[name])
                times[name].append(wall)
                cpus[name].append(used)
        median = {name: statistics.median(t) for name, t in times.items()}
        print(f"{args.files} files x {args.mib} MiB to 2 stores ({total / MiB:.0f} MiB), {args.rounds} rounds, "
              f"part {args.part_mib} MiB x {options.concurrency} in flight; wall median (min-max), "
              f"CPU median (client + stores)")
        for name, t in times.items():
            print(f"{name:34s}: {median[name]:6.2f} s ({min(t):.2f}-{max(t):.2f})  "
                  f"{total / MiB / median[name]:7.1f} MiB/s  CPU {statistics.median(cpus[name]):5.2f} s")
        ours_name = names[-1]
        for base, label in ((names[0], "same-config baseline"), (names[1], "boto3-defaults")):
            # Per-round ratios too: both variants ran back to back, so a slow spell on a
            # shared machine hits both sides of the same ratio.
            paired = statistics.median(b / o for b, o in zip(times[base], times[ours_name]))
            print(f"throughput ratio vs {label:21s}: {median[base] / median[ours_name]:.2f} of medians, "
                  f"{paired:.2f} median of per-round ratios" + ("  (target >= 0.9)" if base == names[0] else ""))
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    command_line(main, __doc__)
