"""The chaos soak's short variant (bench/soak.py): 1.5 minutes of joins, capacity
requests, GPU faults, a provider incident and a rollout of the demo model on the
simulated fleet (node agents through the node gateway, as ``gpufleet dev`` runs
them) while the control-plane worker is SIGKILLed and the dev server restarted;
then the five invariants must all be zero."""

from __future__ import annotations

import pytest

from bench.soak import INVARIANTS, run_soak


@pytest.mark.timeout(300)
async def test_short_chaos_soak_keeps_every_invariant(tmp_path):
    result = await run_soak(minutes=1.5, seed=7, state_dir=tmp_path / "soak", log=lambda _m: None)
    report = result.report()
    # The chaos happened: a soak that injected nothing would pass vacuously.
    for what in ("worker SIGKILLs", "dev-server restarts", "provider incidents", "GPU faults injected",
                 "capacity requests", "rollouts started"):
        assert result.stats.get(what, 0) >= 1, f"{what}: none\n{report}"
    assert result.stats["successful joins"] >= 4, report
    # The rollout ran to an end (completed, or a gate that failed and rolled back: not a hang).
    assert result.stats["rollout"].startswith("rollout/demo-llm/v1: "), report
    # Every node agent reached Temporal only through the node gateway, as on the dev stack.
    assert result.stats["node-queue activities via the gateway"] >= 1, report
    assert result.stats["node-queue activities not via the gateway"] == 0, report
    assert set(result.invariants) == set(INVARIANTS)
    assert result.invariants == {name: 0 for name in INVARIANTS}, report
