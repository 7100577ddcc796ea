"""``gpufleet weights pull`` against moto's S3: verified bytes on the node or no server.

The pod's init step is run as the rendered pod runs it (its command and its
environment), in a subprocess; the model server after it only when it exits 0.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleet.cluster import ServingSpec
from fleet.models import CredentialsRef
from fleet.weights_pull import CACHE_ROOT, ENV, KEY_ENV, WeightsPull
from providers.cluster.kubernetes import render_deployment
from tests.rollout.conftest import MotoS3, put_files
from workers.weights_pull import VERIFIED, WeightsMismatch, pull

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(moto_s3: MotoS3):
    bucket = moto_s3.bucket(moto_s3.store(0))
    files = put_files(moto_s3, bucket, {"config.json": 1_000, "model-00001.safetensors": 300_000})
    return WeightsPull(model="llm", version="v2", store=bucket, files=files)


def _init_step(spec: WeightsPull, cache: Path, site: str = "site-a") -> subprocess.CompletedProcess:
    """The rendered pod's init container, run here: its command, its environment, our cache dir."""
    pod = render_deployment(ServingSpec(model="llm", site=site, image="img", weights=spec), "gpufleet")
    (init,) = pod["spec"]["template"]["spec"]["initContainers"]
    command = [sys.executable if c == "python" else c for c in init["command"]]
    command[command.index(CACHE_ROOT)] = str(cache)
    env = {**os.environ, **{e["name"]: e["value"] for e in init["env"] if "value" in e}}
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_pull_verifies_every_file_and_replicas_share_it(store: WeightsPull, tmp_path: Path):
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(pull(store, tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dest = tmp_path / "llm" / "v2"
    for f in store.files:
        assert hashlib.sha256((dest / f.path).read_bytes()).hexdigest() == f.sha256
    # One replica fetched the bytes, the others waited on the lock and found them verified.
    assert sum(not r.cached for r in reports) == 1
    assert sum(sum(r.fetched.values()) for r in reports) == sum(f.size for f in store.files)
    assert (dest / VERIFIED).exists()


def test_a_corrupted_file_is_refused_and_the_server_never_starts(moto_s3: MotoS3, store: WeightsPull,
                                                                tmp_path: Path, monkeypatch):
    client = moto_s3.client(store.store)
    client.put_object(Bucket=store.store.bucket, Key="model-00001.safetensors", Body=b"\0" * 300_000)
    # The nodes' key reaches the pod from a Secret; here the same variable carries it.
    spec = store.model_copy(update={"store": store.store.model_copy(
        update={"pull_credentials": CredentialsRef(secret="gpufleet/weights-key#key")})})
    monkeypatch.setenv(KEY_ENV, "testing:testing")
    result = _init_step(spec, tmp_path)
    started = result.returncode == 0  # what the kubelet does: the server container only after a 0
    assert not started and result.returncode == 2
    assert "model-00001.safetensors" in result.stderr and "not the manifest's" in result.stderr
    assert "testing" not in result.stderr + result.stdout  # no key in the output
    dest = tmp_path / "llm" / "v2"
    assert not (dest / "model-00001.safetensors").exists() and not (dest / VERIFIED).exists()
    with pytest.raises(WeightsMismatch, match="model-00001.safetensors"):
        pull(store, tmp_path / "again")


def test_an_interrupted_pull_resumes_from_its_partial_file(moto_s3: MotoS3, tmp_path: Path):
    bucket = moto_s3.bucket(moto_s3.store(0))
    files = put_files(moto_s3, bucket, {"big.safetensors": 3_000_000})
    spec = WeightsPull(model="llm", version="v2", store=bucket, files=files)
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    # A pull capped at 1 MB/s, killed while it copies (a node losing power, an OOM kill).
    proc = subprocess.Popen([sys.executable, "-m", "workers.weights_pull", str(tmp_path / "spec.json"),
                             "--cache", str(tmp_path / "cache"), "--bandwidth", "1000000"], cwd=ROOT)
    partial = tmp_path / "cache" / "llm" / "v2" / "big.safetensors.partial"
    deadline = time.monotonic() + 30
    while not (partial.exists() and partial.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    done = partial.stat().st_size
    assert 0 < done < 3_000_000
    report = pull(spec, tmp_path / "cache")
    assert report.resumed == ["big.safetensors"]
    assert report.fetched["big.safetensors"] == 3_000_000 - done  # only the rest came over the wire
    data = (tmp_path / "cache" / "llm" / "v2" / "big.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() == files[0]["sha256"]


def test_a_bad_partial_is_fetched_again_from_the_start(store: WeightsPull, tmp_path: Path):
    dest = tmp_path / "llm" / "v2"
    dest.mkdir(parents=True)
    (dest / "model-00001.safetensors.partial").write_bytes(b"garbage" * 1000)
    report = pull(store, tmp_path)
    assert report.fetched["model-00001.safetensors"] == 300_000 - 7000 + 300_000
    assert (dest / VERIFIED).exists()


def test_the_serving_pod_has_the_init_step_and_the_readiness_probe(store: WeightsPull):
    spec = store.model_copy(update={"store": store.store.model_copy(
        update={"pull_credentials": CredentialsRef(secret="gpufleet/weights-key#key")})})
    deployment = render_deployment(ServingSpec(model="llm", site="site-a", image="vllm", weights=spec), "gpufleet")
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["python", "-m", "workers.weights_pull"]
    key = next(e for e in init["env"] if e["name"] == KEY_ENV)
    assert key["valueFrom"]["secretKeyRef"] == {"name": "weights-key", "key": "key"}
    carried = WeightsPull.model_validate_json(next(e["value"] for e in init["env"] if e["name"] == ENV))
    assert carried.store.credentials == CredentialsRef(env=KEY_ENV) and carried.files == store.files
    (server,) = pod["containers"]
    assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "MODEL_WEIGHTS", "value": f"{CACHE_ROOT}/llm/v2"} in server["env"]
    assert server["volumeMounts"] == [{"name": "weights-cache", "mountPath": CACHE_ROOT, "readOnly": True}]
    assert pod["volumes"] == [{"name": "weights-cache", "hostPath": {"path": CACHE_ROOT, "type": "DirectoryOrCreate"}}]
    assert not any("hostPath" in v and v["hostPath"]["path"].startswith("/models") for v in pod["volumes"])
