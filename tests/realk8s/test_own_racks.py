"""deploy/own-racks (the base with own racks' seed server in the control-plane pod) on the real
control plane, where the conftest has applied the base: ``kubectl apply --server-side -k
deploy/own-racks`` as an operator runs it, as a server-side dry run (a rollout here would never
finish: no kubelet runs the new pod), so the real API server validates and admits the changed
Deployment over the base's while the tier's other tests keep the base's pod, its rollout one
pod at a time (tests/test_deploy.py says why), where Recreate would be refused.

The seed server's own behaviour (one fetch, only from the machine's address) is
tests/providers/test_own_dc_seed.py; what the overlay says to the worker and the server (one
seed_dir, the config and template paths, the image) is tests/test_deploy.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.realk8s.cluster import RealCluster
from tests.test_deploy import rendered, workloads

REPO = Path(__file__).resolve().parents[2]


def test_the_own_racks_overlay_is_accepted_over_the_applied_base(real_cluster: RealCluster) -> None:
    # --force-conflicts: the tier's Helm test takes the base's objects over (field manager helm),
    # and this apply names them all; a dry run changes nothing, whoever owns them.
    done = real_cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts", "-o", "json",
                                "-k", str(REPO / "deploy" / "own-racks"))
    answered = json.loads(done.stdout)
    items = answered["items"] if answered.get("kind") == "List" else [answered]
    (deployment,) = [i for i in items if i["kind"] == "Deployment" and i["metadata"]["name"] == "gpufleet-control-plane"]
    # Over the base's strategy (RollingUpdate, as the API server defaulted it): one pod at a time.
    # tests/test_deploy.py says why; Recreate, which would say so too, is refused over it.
    live_strategy = json.loads(real_cluster.kubectl("get", "deployment", "gpufleet-control-plane", "-n", "gpufleet",
                                                    "-o", "json").stdout)["spec"]["strategy"]
    assert live_strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    recreate = workloads(rendered("own-racks"))["gpufleet-control-plane"]
    recreate["spec"]["strategy"] = {"type": "Recreate"}
    refused = real_cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts", "-f", "-",
                                   input=json.dumps(recreate), check=False)
    assert refused.returncode != 0 and "may not be specified when strategy `type` is 'Recreate'" in refused.stderr, \
        refused.stderr
    pod = deployment["spec"]["template"]["spec"]
    wanted = workloads(rendered("own-racks"))["gpufleet-control-plane"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == [c["name"] for c in wanted["containers"]] == [
        "worker", "own-rack-seeds"]
    for container, asked in zip(pod["containers"], wanted["containers"]):
        assert container["command"] == asked["command"] and container["image"] == asked["image"]
        assert {(m["name"], m["mountPath"]) for m in container["volumeMounts"]} == {
            (m["name"], m["mountPath"]) for m in asked["volumeMounts"]}, container["name"]
    (seeds,) = [v for v in pod["volumes"] if v["name"] == "seeds"]
    assert seeds["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Mi"}
    # A dry run: the base's pod template as the conftest applied it.
    live = json.loads(real_cluster.kubectl("get", "deployment", "gpufleet-control-plane", "-n", "gpufleet",
                                           "-o", "json").stdout)
    assert [c["name"] for c in live["spec"]["template"]["spec"]["containers"]] == ["worker"]
