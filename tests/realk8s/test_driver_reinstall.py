"""deploy/driver-reinstall (the node agent with the repair ladder's driver reinstall) on the real
control plane, where the conftest has applied the base: ``kubectl apply --server-side -k`` of a
kustomization of an operator's own, the base with the component, as a server-side dry run (the
tier's other tests keep the base's node agent), so the real API server validates and admits the
changed DaemonSet over the base's. What its command runs is tests/test_driver_reinstall.py."""

from __future__ import annotations

import json
from pathlib import Path

from fleet.repair_policy import DRIVER_REINSTALL_SCRIPT
from tests.realk8s.cluster import RealCluster
from tests.test_deploy import kustomization_with


def test_the_driver_reinstall_component_is_accepted_over_the_applied_base(real_cluster: RealCluster,
                                                                          tmp_path: Path) -> None:
    done = real_cluster.kubectl("apply", "--server-side", "--dry-run=server", "-o", "json",
                                "-k", str(kustomization_with(tmp_path, ["kubernetes"], ["driver-reinstall"])))
    answered = json.loads(done.stdout)
    items = answered["items"] if answered.get("kind") == "List" else [answered]
    (daemonset,) = [i for i in items if i["kind"] == "DaemonSet" and i["metadata"]["name"] == "gpufleet-node-agent"]
    pod = daemonset["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert pod["hostPID"] is True and agent["securityContext"]["privileged"] is True
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["GPUFLEET_DRIVER_REINSTALL_CMD"].endswith(f" -- {DRIVER_REINSTALL_SCRIPT}")
    # A dry run: the base's node agent as the conftest applied it.
    live = json.loads(real_cluster.kubectl("get", "daemonset", "gpufleet-node-agent", "-n", "gpufleet",
                                           "-o", "json").stdout)["spec"]["template"]["spec"]
    assert not live.get("hostPID") and live["containers"][0]["securityContext"]["privileged"] is False
