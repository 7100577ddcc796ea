"""Weights replication vs plain boto3, same files, same two moto stores, same run.

``Replicator`` (what the ``replicate_weights`` activity runs: sha256 while
streaming, ChecksumSHA256 on every upload for the store to check, heartbeat
bookkeeping) against the plain copy ``upload_fileobj(get_object()["Body"])``
(boto3's managed transfer) of the same files. Both copy to two stores at once (a
thread per store), rounds alternate, fresh destination buckets each time.

    python -m bench.replicate [--files 8] [--mib 8] [--rounds 3]

Note: moto accepts ChecksumSHA256 without checking it, as a store that checks
would; what is measured is our side's cost.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from activities.weights import ReplicateInput, Replicator, make_s3_client
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


def store(endpoint: str) -> ObjectStore:
    return ObjectStore(endpoint_url=endpoint, bucket=f"b-{uuid.uuid4().hex[:10]}", addressing_style="path",
                       credentials=CredentialsRef(env="BENCH_S3_KEY"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part-mib", type=int, default=8)
    args = parser.parse_args()
    os.environ["BENCH_S3_KEY"] = "bench:bench"
    servers = [start_moto(), start_moto()]
    try:
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
        options = Replication(part_size_bytes=args.part_mib * MiB, chunk_size_bytes=1 * MiB, concurrency=4)

        def ours(endpoint: str) -> None:
            dest = store(endpoint)
            client = make_s3_client(dest, 16)
            client.create_bucket(Bucket=dest.bucket)
            result = Replicator(ReplicateInput(site="bench", source=source, files=files, dest_prefix="w/",
                                               options=options), dest, make_s3_client(source, 16), client).run()
            assert set(result.files.values()) == {"copied"}

        def plain(endpoint: str) -> None:
            import boto3

            dest = store(endpoint)
            kwargs = dict(aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1")
            s = boto3.client("s3", endpoint_url=source.endpoint_url, **kwargs)
            d = boto3.client("s3", endpoint_url=endpoint, **kwargs)
            d.create_bucket(Bucket=dest.bucket)
            for f in files:
                body = s.get_object(Bucket=source.bucket, Key=f.path)["Body"]
                d.upload_fileobj(body, dest.bucket, f"w/{f.path}")

        def timed(fn) -> float:
            start = time.perf_counter()
            with ThreadPoolExecutor(len(endpoints)) as pool:
                list(pool.map(fn, endpoints))
            return time.perf_counter() - start

        timed(plain)  # warm-up
        plain_times, our_times = [], []
        for _ in range(args.rounds):
            plain_times.append(timed(plain))
            our_times.append(timed(ours))
        p, o = statistics.median(plain_times), statistics.median(our_times)
        print(f"{args.files} files x {args.mib} MiB to 2 stores ({total / MiB:.0f} MiB), {args.rounds} rounds")
        print(f"plain boto3        : {p:6.2f} s  {total / MiB / p:7.1f} MiB/s")
        print(f"replicate (verify) : {o:6.2f} s  {total / MiB / o:7.1f} MiB/s")
        print(f"throughput ratio   : {p / o:.2f}  (target >= 0.9)")
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
