"""The repair policy table and escalation, without Temporal."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from fleet.models import GpuHealth, XidEvent
from fleet.repair_policy import (
    LADDER,
    MAX_XID_HITS_PER_GPU,
    Ledger,
    RepairSettings,
    RepairThresholds,
    Rung,
    classify,
    fingerprint,
)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def gpu(*xids: int, **fields) -> GpuHealth:
    fields = {"index": 0, "temperature_c": 40, "slowdown_temperature_c": 90, **fields}
    return GpuHealth(uuid="GPU-x", xid_events=[XidEvent(xid=x, at=T0) for x in xids], **fields)


def test_ladder_is_ordered() -> None:
    assert LADDER == [Rung.RESET, Rung.REBOOT, Rung.REINSTALL, Rung.REPLACE]
    assert Rung.RESET.next() == Rung.REBOOT and Rung.REPLACE.next() is None
    assert not Rung.RESET.node_level and Rung.REBOOT.node_level


@pytest.mark.parametrize("xid", [13, 31, 43, 45])
def test_application_xids_count_but_never_repair(xid: int) -> None:
    finding = classify(gpu(xid))
    assert finding.rung is None
    assert finding.app_xids == [xid]


@pytest.mark.parametrize("xid", [48, 63, 64, 94, 95, 119, 120, 140])
def test_reset_xids(xid: int) -> None:
    assert classify(gpu(xid)).rung == Rung.RESET


@pytest.mark.parametrize("xid", [79, 74])
def test_reboot_xids(xid: int) -> None:
    assert classify(gpu(xid)).rung == Rung.REBOOT


def test_conditions() -> None:
    assert classify(gpu(lost=True)).rung == Rung.REBOOT
    assert classify(gpu(remapped_rows_failure=True)).rung == Rung.REPLACE
    assert classify(gpu(remapped_rows_pending=True)).rung == Rung.RESET
    assert classify(gpu(retired_pages_pending=True)).rung == Rung.RESET
    assert classify(gpu(ecc_uncorrected=2)).rung == Rung.RESET
    assert classify(gpu(nvlink_down=1)).rung == Rung.REBOOT
    assert classify(gpu(temperature_c=95)).rung == Rung.RESET
    assert classify(gpu()).rung is None


def test_highest_rung_wins_and_unknown_xids_are_not_repaired() -> None:
    assert classify(gpu(48, 79)).rung == Rung.REBOOT
    finding = classify(gpu(9999))
    assert finding.rung is None and finding.unknown_xids == [9999]


def test_recovery_action_wins() -> None:
    assert classify(gpu(79, recovery_action=1)).rung == Rung.RESET, "driver says reset: reset"
    assert classify(gpu(48, recovery_action=2)).rung == Rung.REBOOT
    assert classify(gpu(recovery_action=4)).rung == Rung.RESET
    assert classify(gpu(recovery_action=1, remapped_rows_failure=True)).rung == Rung.REPLACE


def test_same_fatal_xid_five_times_a_day_escalates_to_replace() -> None:
    limits = RepairThresholds(node_remediation_limit=100)
    ledger = Ledger()
    now = T0.timestamp()
    for i in range(4):
        ledger.record_xids(0, [48], now + i, limits)
    finding = classify(gpu(48))
    assert ledger.escalate(finding, now + 10, limits)[0] == Rung.RESET
    ledger.record_xids(0, [48], now + 5, limits)
    rung, why = ledger.escalate(finding, now + 10, limits)
    assert rung == Rung.REPLACE and "XID 48" in why
    # Another GPU's hits do not count; hits older than the window fall out.
    assert ledger.escalate(classify(gpu(48, index=1)), now + 10, limits)[0] == Rung.RESET
    assert ledger.escalate(finding, now + 25 * 3600, limits)[0] == Rung.RESET


def test_the_ledger_stays_bounded_and_escalates_the_same() -> None:
    """A node reporting fresh fatal XIDs in every answer (64 of them on each of a GPU's entries)
    cannot grow the carried ledger: hits past the window go when recorded, of one GPU and XID the
    newest ``same_xid_limit`` are kept (all ``escalate`` asks), and a GPU keeps at most
    ``MAX_XID_HITS_PER_GPU``, counted when dropped. Escalation decides as before."""
    limits = RepairThresholds(node_remediation_limit=100, same_xid_window_seconds=3600)
    ledger = Ledger()
    now = T0.timestamp()
    for report in range(100):
        assert ledger.record_xids(0, [79] * 64, now + report, limits) == 0
    assert len(ledger.xid_hits) == limits.same_xid_limit
    assert [h.at for h in ledger.xid_hits] == [now + 99] * limits.same_xid_limit, "the newest, oldest first"
    assert ledger.escalate(classify(gpu(79)), now + 100, limits)[0] == Rung.REPLACE

    # Every fatal XID of the table, past the per-GPU cap: the newest kept, the rest counted.
    fatal = [48, 63, 64, 94, 95, 119, 120, 140, 74, 79]
    many = RepairThresholds(same_xid_limit=MAX_XID_HITS_PER_GPU, same_xid_window_seconds=3600)
    ledger = Ledger()
    assert ledger.record_xids(1, fatal * 6, now, many) == 0, "60: under the cap"
    dropped = ledger.record_xids(1, fatal * 6, now + 1, many)
    assert dropped == 2 * 60 - MAX_XID_HITS_PER_GPU
    assert len(ledger.xid_hits) == MAX_XID_HITS_PER_GPU
    assert sum(h.at == now + 1 for h in ledger.xid_hits) == 60, "the newest kept"
    assert ledger.record_xids(2, [48], now + 2, many) == 0, "another GPU has a cap of its own"

    # Past the window a GPU's hits go at the next record, whichever GPU it is for.
    ledger.record_xids(0, [48], now + 3600 + 2, many)
    assert [(h.gpu, h.xid) for h in ledger.xid_hits] == [(0, 48)]


def test_the_same_xid_limit_is_no_more_than_the_ledger_keeps() -> None:
    with pytest.raises(ValueError, match="same_xid_limit"):
        RepairThresholds(same_xid_limit=MAX_XID_HITS_PER_GPU + 1)


def test_node_remediations_escalate_to_replace() -> None:
    limits = RepairThresholds(node_remediation_limit=3, node_remediation_window_seconds=100)
    ledger = Ledger()
    ledger.record_remediation(0)
    assert ledger.escalate(classify(gpu(48)), 1, limits)[0] == Rung.RESET
    ledger.record_remediation(1)
    assert ledger.escalate(classify(gpu(48)), 2, limits)[0] == Rung.REPLACE
    assert ledger.escalate(classify(gpu(48)), 150, limits)[0] == Rung.RESET, "old remediations expire"
    assert ledger.escalate(classify(gpu(13)), 2, limits)[0] is None


def test_a_slot_holder_is_expected_back_within_its_rungs_timeouts() -> None:
    """What a repair queued for the node's action slot is told: the holder's rung's timeouts, a
    reboot or reimage through the provider including its call (reinstall by the agent: none)."""
    settings = RepairSettings.model_validate({"timeouts": {
        "reset_seconds": 300, "reboot_seconds": 900, "reinstall_seconds": 3600, "replace_seconds": 7200,
        "provider_call_seconds": 120}})
    assert [settings.slot_seconds(r) for r in LADDER] == [300, 120 + 900, 120 + 3600, 7200]
    by_agent = settings.model_copy(update={"reinstall_via": "agent"})
    assert by_agent.slot_seconds(Rung.REINSTALL) == 3600


def test_fingerprint_ignores_temperature_noise_but_not_faults() -> None:
    a = fingerprint("boot", [gpu(temperature_c=40)])
    assert a == fingerprint("boot", [gpu(temperature_c=55)])
    assert a != fingerprint("boot", [gpu(temperature_c=91)])
    assert a != fingerprint("boot", [gpu(48)])
    assert a != fingerprint("other-boot", [gpu(temperature_c=40)])
