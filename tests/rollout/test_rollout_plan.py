"""ModelRollout's pure parts, without Temporal."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleet.config import ObjectStore
from fleet.rollout import (
    HealthGate,
    ProbeResult,
    RolloutInput,
    RolloutProgress,
    SiteProgress,
    SiteState,
    check_routed_sites,
    check_sites,
    evaluate_gate,
    next_batch,
    part_size_for,
    plan_batches,
    render_details,
)

SHA = "a" * 64


def raw(**overrides) -> dict:
    base = {
        "model": "llm", "version": "v2", "image": "img:v2",
        "weights": {"source": {"store": "src"}, "files": [{"path": "w.bin", "size": 10, "sha256": SHA}]},
        "sites": [{"site": "a", "replicas": 2}, {"site": "b", "replicas": 1}],
    }
    base.update(overrides)
    return base


def test_valid_input_defaults() -> None:
    request = RolloutInput.model_validate(raw())
    assert request.rollout_id == "rollout/llm/v2"
    assert request.canaries == ["a"]
    assert request.weights_path == "/models/llm/v2"
    assert request.dest_prefix(ObjectStore(bucket="x", prefix="p/")) == "p/models/llm/v2/"


@pytest.mark.parametrize("change, field", [
    ({"weights": {"source": {"store": "s"}, "files": [{"path": "w", "size": 1}]}}, "sha256"),
    ({"weights": {"source": {"store": "s"}, "files": [{"path": "w", "size": 1, "sha256": "xyz"}]}}, "sha256"),
    ({"weights": {"source": {"store": "s"}, "files": [{"path": "../w", "size": 1, "sha256": SHA}]}}, "path"),
    ({"weights": {"source": {"store": "s"}, "files": []}}, "files"),
    ({"sites": [{"site": "a", "replicas": 0}, {"site": "b", "replicas": 0}]}, "zero replicas everywhere"),
    ({"sites": [{"site": "a", "replicas": 1}, {"site": "a", "replicas": 1}]}, "more than once"),
    ({"strategy": {"canary_sites": ["zz"]}}, "canary_sites"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_manifests_rejected(change: dict, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RolloutInput.model_validate(raw(**change))
    assert field in str(caught.value)


def test_check_sites() -> None:
    request = RolloutInput.model_validate(raw(sites=[{"site": "a", "replicas": 1}, {"site": "nope", "replicas": 1},
                                                     {"site": "c", "replicas": 1}]))
    problems = check_sites(request, {"a": ObjectStore(bucket="x"), "c": None}, ["a", "c"], {"a": 8, "c": 8})
    assert len(problems) == 2
    assert "unknown site 'nope'" in problems[0]
    assert "no object_store" in problems[1]


def test_a_replica_larger_than_a_sites_machines_is_refused_naming_the_sites() -> None:
    """Its pods could never be scheduled there: the rollout copied every weight, waited out
    ``ready_timeout_seconds`` and rolled back. A site given no replicas places no pod."""
    stores = {name: ObjectStore(bucket=name) for name in "abc"}
    request = RolloutInput.model_validate(raw(gpus_per_replica=8, sites=[
        {"site": "a", "replicas": 1}, {"site": "b", "replicas": 1}, {"site": "c", "replicas": 0}]))
    assert check_sites(request, stores, "abc", {"a": 8, "b": 8, "c": 1}) == []
    (problem,) = check_sites(request, stores, "abc", {"a": 8, "b": 4, "c": 2})
    assert problem.startswith("gpus_per_replica: 8 GPUs per replica"), problem
    assert "b (4 GPUs per machine)" in problem and "a (" not in problem and "c (" not in problem


def test_plan_batches_and_deferral() -> None:
    assert plan_batches(["a", "b", "c", "d", "e"], ["b"], 2) == [["b"], ["a", "c"], ["d", "e"]]
    assert plan_batches(["a", "b"], ["a", "b"], 3) == [["a"], ["b"]]
    batch, deferred = next_batch(["c", "d", "e"], {"d"}, 2)
    assert batch == ["c", "e"] and deferred == ["d"]
    assert next_batch(["d"], {"d"}, 2) == ([], ["d"])


def test_gate_verdicts() -> None:
    gate = HealthGate(probe_requests=10, max_error_rate=0.1)
    assert not evaluate_gate(gate, False, None).passed
    assert evaluate_gate(gate, True, ProbeResult(site="a", sent=10, errors=1)).passed
    verdict = evaluate_gate(gate, True, ProbeResult(site="a", sent=10, errors=2, samples=["HTTP 500"]))
    assert not verdict.passed and "2 of 10" in verdict.reason and "HTTP 500" in verdict.reason
    assert not evaluate_gate(gate, True, ProbeResult(site="a", sent=3, errors=0)).passed
    assert evaluate_gate(HealthGate(probe_requests=0), True, None).passed


def test_part_size_fits_max_parts() -> None:
    assert part_size_for(100, 64) == 64
    assert part_size_for(10_000 * 64 + 1, 64) == 65


def test_details_table() -> None:
    progress = RolloutProgress(rollout_id="rollout/llm/v2", model="llm", version="v2", phase="canary", batch=1,
                               batches=2, sites=[SiteProgress(site="a", replicas=2, canary=True,
                                                              state=SiteState.GATING, bytes_total=2048, files_total=1)])
    text = render_details(progress)
    assert "| a (canary) | 2 | gating |" in text and "batch 1 of 2" in text


def test_shipped_example_rollout_is_valid() -> None:
    from pathlib import Path

    import yaml

    from fleet.rollout import RolloutInput

    example = Path(__file__).resolve().parents[2] / "deploy" / "rollout.example.yaml"
    rollout = RolloutInput.model_validate(yaml.safe_load(example.read_text()))
    assert rollout.strategy.canary_sites == ["aws-us-east-1"]
    assert {s.site for s in rollout.sites} >= set(rollout.strategy.canary_sites)


@pytest.mark.parametrize("source, field", [
    ({"store": "src", "endpoint_url": "https://evil.example"}, "endpoint_url"),
    ({"store": "src", "credentials": {"env": "AWS_SECRET"}}, "credentials"),
    ({"bucket": "src"}, "store"),
    ({"store": "src", "prefix": "../other/"}, "prefix"),
    ({"store": "src", "prefix": "no-slash"}, "prefix"),
])
def test_manifest_names_a_source_store_and_cannot_choose_endpoint_or_credentials(source: dict, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RolloutInput.model_validate(raw(weights={"source": source, "files": [{"path": "w", "size": 1, "sha256": SHA}]}))
    assert field in str(caught.value)


def test_check_source_names_the_field_and_the_known_stores() -> None:
    from fleet.rollout import check_source

    request = RolloutInput.model_validate(raw())
    assert check_source(request, ["src", "other"]) == []
    (problem,) = check_source(request, ["other"])
    assert problem.startswith("weights.source.store: unknown object store 'src'") and "other" in problem


def _shards(count: int) -> list[dict]:
    return [{"path": f"model-{i:05d}-of-{count:05d}.safetensors", "size": 5 * 10**9, "sha256": SHA}
            for i in range(count)]


def test_a_manifest_too_big_for_a_deployment_is_refused_naming_the_files_and_the_limit() -> None:
    """The Kubernetes adapter keeps the manifest in the pod template, which a Deployment holds
    twice in its annotations (256 KiB in all): 1000 shards would be refused (422) at every site's
    update, after the copies; so the rollout is refused at start, naming the field."""
    from client.errors import InvalidArgument
    from client.fleet import validate

    with pytest.raises(ValidationError) as caught:
        RolloutInput.model_validate(raw(weights={"source": {"store": "src"}, "files": _shards(1000)}))
    (error,) = caught.value.errors()
    assert error["loc"] == ("weights", "files")
    assert "1000 files take 144" in error["msg"] and "at most 112 KiB" in error["msg"], error["msg"]
    assert "256 KiB" in error["msg"] and "fewer, larger files" in error["msg"]
    with pytest.raises(InvalidArgument) as refused:
        validate(RolloutInput, raw(weights={"source": {"store": "src"}, "files": _shards(1000)}), "rollout")
    assert refused.value.field == "weights.files"
    assert RolloutInput.model_validate(raw(weights={"source": {"store": "src"}, "files": _shards(700)}))


@pytest.mark.parametrize("name", ["", "A=B", "HF_TOKEN\n", "MODÈLE", "MY VAR", "1ST"])
def test_an_env_name_kubernetes_refuses_is_refused_at_start_naming_the_field(name: str) -> None:
    """Each key of ``env`` names an environment variable of the model server's container: one
    Kubernetes refuses (empty, with '=', a line break or no ASCII, by every version; a space or a
    leading digit, by 1.31, the oldest the fleet supports) failed the canary's
    Deployment write (422), after the weights were copied to every site. Refused at start now."""
    from client.errors import InvalidArgument
    from client.fleet import validate

    with pytest.raises(ValidationError) as caught:
        RolloutInput.model_validate(raw(env={"HF_HOME": "/cache", name: "1"}))
    (error,) = caught.value.errors()
    assert error["loc"] == ("env",)
    assert f"{name!r} is not an environment variable name Kubernetes takes" in error["msg"], error["msg"]
    with pytest.raises(InvalidArgument) as refused:
        validate(RolloutInput, raw(env={name: "1"}), "rollout")
    assert refused.value.field == "env"
    assert RolloutInput.model_validate(raw(env={"HF_HOME": "/cache", "vllm.flag-x_1": "a=b\nc", "_X": ""}))


def test_args_and_env_count_with_the_manifest_against_the_same_limit() -> None:
    request = raw(weights={"source": {"store": "src"}, "files": _shards(700)}, args=["--chat-template", "x" * 20_000])
    with pytest.raises(ValidationError, match="weights.files, image, args and env together take .* at most 112 KiB"):
        RolloutInput.model_validate(request)


def test_a_rollout_to_more_sites_than_a_route_can_reach_is_refused() -> None:
    """Each target site gets a Deployment, and the model's HTTPRoute one backendRef per such site;
    Gateway API allows 16 in a rule."""
    sites = [{"site": f"s{i}", "replicas": 1} for i in range(17)]
    with pytest.raises(ValidationError, match="sites: 17 target sites; a model is routed to at most 16"):
        RolloutInput.model_validate(raw(sites=sites))
    assert RolloutInput.model_validate(raw(sites=sites[:16]))


def test_the_sites_a_model_is_served_at_count_against_its_route() -> None:
    """A rollout retires no site, so the model's route ends with a backendRef for every site it
    is served at and every target: 16 at most."""
    served = [f"old-{i:02d}" for i in range(14)]
    assert check_routed_sites("llm", ["old-00", "site-a", "site-b"], served) == []
    (problem,) = check_routed_sites("llm", ["site-a", "site-b", "site-c"], served)
    assert problem == ("sites: 'llm' would be routed to 17 sites, at most 16 (its HTTPRoute's backendRefs, "
                       "Gateway API's limit): the target sites (site-a, site-b, site-c); the sites it is served at "
                       f"already ({', '.join(served)}). A rollout retires no site: target fewer sites it is not "
                       "served at"), problem
