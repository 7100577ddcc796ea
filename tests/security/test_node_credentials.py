"""What a GPU node is given to pull its weights. A node is hostile: its kubelet may read the whole
of every Secret a pod bound to it names (the Node authorizer), and root on the machine reads its
containers' environment. So a serving pod, which runs on a GPU node, must name no Secret the
control plane's config names: a site store's ``credentials`` are the control plane's, which
replicate weights there (PutObject, DeleteObject, AbortMultipartUpload: every version every node
at the site loads); with them a node could overwrite or delete what the other machines serve,
and, with a ``sha256`` metadata matching the manifest, keep the control plane's copy from putting
it back. A node is given only the store's ``pull_credentials`` (read-only, a Secret of its own),
or no key at all (its machine's role)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from fleet.cluster import ServingSpec
from fleet.config import ConfigError, FleetConfig, parse_config
from fleet.models import CredentialsRef
from fleet.rollout import WeightFile
from fleet.weights_pull import ENV as WEIGHTS_ENV
from fleet.weights_pull import KEY_ENV, WeightsPull
from providers.cluster.kubernetes import render_deployment
from providers.credentials import control_plane_secrets, credentials_role

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "sites.example.yaml"
SITE = "nebius-eu-north"
WRITER = "gpufleet/nebius-store#credentials"


def example(**store: Any) -> dict[str, Any]:
    """The shipped example with a store at one site, its key the control plane's, as an operator
    writes it (deploy/sites.example.yaml names the Secrets of every other credential)."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    site = next(s for s in raw["sites"] if s["name"] == SITE)
    site["object_store"] = {"bucket": "nebius-weights", "endpoint_url": "https://storage.eu-north1.nebius.cloud",
                            "credentials": {"secret": WRITER}, **store}
    return raw


def served_pod(config: FleetConfig) -> dict[str, Any]:
    """The pod a rollout puts on the site's GPU nodes (workflows/rollout.py ``_update_site``: the
    site's store as the config names it), as the Kubernetes adapter renders it."""
    store = config.site(SITE).object_store
    files = [WeightFile(path="model.safetensors", size=10, sha256="a" * 64)]
    pull = WeightsPull(model="llm", version="v2", store=store, prefix="models/llm/v2/", files=files)
    spec = ServingSpec(model="llm", site=SITE, image="vllm/vllm-openai:v0.6.3", weights=pull)
    return render_deployment(spec, "gpufleet")["spec"]["template"]["spec"]


def secrets_named(pod: dict[str, Any]) -> set[str]:
    """Every Secret a pod names, each a Secret its node's kubelet may then read whole."""
    names: set[str] = {s["name"] for s in pod.get("imagePullSecrets", [])}
    for container in pod.get("initContainers", []) + pod["containers"]:
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}
        names |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        names |= {s["secret"]["name"] for s in volume.get("projected", {}).get("sources", []) if "secret" in s}
    return names


def carried_store(pod: dict[str, Any]):
    (init,) = pod["initContainers"]
    return WeightsPull.model_validate_json(next(e["value"] for e in init["env"] if e["name"] == WEIGHTS_ENV)).store


def test_the_control_planes_store_key_is_never_given_to_a_node():
    """Before: the pod's weights step took the store's ``credentials`` Secret (``secretKeyRef``
    nebius-store), so every node a replica ran on could read the key the control plane writes
    and deletes the site's weights with."""
    config = parse_config(example())
    assert "nebius-store" in control_plane_secrets(config), "the control plane reads its store key"
    pod = served_pod(config)
    assert secrets_named(pod) & set(control_plane_secrets(config)) == set()
    assert secrets_named(pod) == set()
    assert carried_store(pod).credentials is None  # the node's own role, or an anonymous read


def test_a_node_is_given_the_read_key_its_config_names_for_it_and_the_control_plane_never_reads_it():
    config = parse_config(example(pull_credentials={"secret": "gpufleet/nebius-store-read#credentials"}))
    pod = served_pod(config)
    assert secrets_named(pod) == {"nebius-store-read"}
    (init,) = pod["initContainers"]
    key = next(e for e in init["env"] if e["name"] == KEY_ENV)
    assert key["valueFrom"]["secretKeyRef"] == {"name": "nebius-store-read", "key": "credentials"}
    store = carried_store(pod)
    assert store.credentials == CredentialsRef(env=KEY_ENV) and store.pull_credentials is None
    # The control plane neither reads the node's key nor may: its Role does not name that Secret.
    assert "nebius-store-read" not in control_plane_secrets(config)
    role, _ = credentials_role(config)
    assert all("nebius-store-read" not in rule["resourceNames"] for rule in role["rules"])


@pytest.mark.parametrize("secret", ["gpufleet/nebius-store#read", "gpufleet/aws-prod#store-read"])
def test_a_node_key_in_a_secret_that_holds_a_control_plane_key_is_refused(secret: str):
    """A kubelet reads a Secret whole, not the one key its pod names: a read-only key kept beside
    the store's writer key, or beside a provider account's (which buys and deletes machines), would
    hand the node that one too."""
    with pytest.raises(ConfigError) as error:
        parse_config(example(pull_credentials={"secret": secret}))
    (problem,) = error.value.problems
    assert problem.startswith(f"sites[3] ({SITE}).object_store.pull_credentials: the Secret {secret.split('#')[0]} ")
    assert "a Secret of its own" in problem


@pytest.mark.parametrize("ref", [{"env": "STORE_READ_KEY"}, {"file": "/etc/keys/read"}, {"secret": "nebius-read"}])
def test_a_node_key_is_refused_unless_it_names_a_secret(ref: dict[str, str]):
    """An env or file reference is the control plane's process's, which no pod on a node has."""
    with pytest.raises(ConfigError) as error:
        parse_config(example(pull_credentials=ref))
    assert any(p.startswith(f"sites[3] ({SITE}).object_store.pull_credentials") and "a Secret of its own" in p
               for p in error.value.problems), error.value.problems


def test_config_check_warns_of_a_store_whose_nodes_are_given_no_key(tmp_path: Path):
    """An operator upgrading a config whose site store's key is a Secret is told that its nodes
    no longer get that key, and what to name instead."""
    def check(raw: dict[str, Any]) -> str:
        path = tmp_path / "sites.yaml"
        path.write_text(yaml.safe_dump(raw))
        result = CliRunner().invoke(app, ["config", "check", str(path)])
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split())

    flat = check(example())
    assert f"warning: sites[3] ({SITE}).object_store: no pull_credentials" in flat
    assert "name a read-only key in a Secret of its own" in flat
    flat = check(example(pull_credentials={"secret": "gpufleet/nebius-store-read#credentials"}))
    assert "pull_credentials" not in flat
    raw = copy.deepcopy(example())
    next(s for s in raw["sites"] if s["name"] == SITE)["object_store"]["credentials"] = {"env": "STORE_KEY"}
    assert "pull_credentials" not in check(raw)  # never given to a node, before either
