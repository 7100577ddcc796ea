"""Rollouts update a site's Deployment with surge, so no serving capacity is lost."""

from fleet.cluster import ServingSpec
from providers.cluster.kubernetes import render_deployment


def test_updates_surge_and_keep_every_replica_available() -> None:
    spec = ServingSpec(model="llama", site="site-a", image="vllm:1", replicas=3, gpus_per_replica=2)
    strategy = render_deployment(spec, "gpufleet")["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 1, "maxUnavailable": 0}


def test_without_spare_gpus_pods_are_replaced_one_at_a_time() -> None:
    spec = ServingSpec(model="llama", site="site-a", image="vllm:1", replicas=3, max_surge=0)
    strategy = render_deployment(spec, "gpufleet")["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}
