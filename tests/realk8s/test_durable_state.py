"""``mode: real`` keeps no control-plane state on local disk (issue 13, item 6), with the real
control plane: two control-plane workers, one after the other with empty disks, each as the
``gpufleet-control-plane`` service account under the shipped RBAC (tests/test_durable_state.py
says what the test proves)."""

from __future__ import annotations

from tests.realk8s.test_backup import control_plane_kubeconfig
from tests.test_durable_state import restarted_control_plane_forgets_nothing


async def test_a_restarted_control_plane_with_an_empty_disk_forgets_nothing(
        temporal_env, tmp_path, monkeypatch, request, real_cluster) -> None:
    await restarted_control_plane_forgets_nothing(temporal_env, tmp_path, monkeypatch, request,
                                                  control_plane_kubeconfig(real_cluster, tmp_path))
