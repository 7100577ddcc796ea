"""The repair policy table and escalation, without Temporal."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from fleet.models import GpuHealth, XidEvent
from fleet.repair_policy import (
    LADDER,
    Ledger,
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
        ledger.record_xids(0, [48], now + i)
    finding = classify(gpu(48))
    assert ledger.escalate(finding, now + 10, limits)[0] == Rung.RESET
    ledger.record_xids(0, [48], now + 5)
    rung, why = ledger.escalate(finding, now + 10, limits)
    assert rung == Rung.REPLACE and "XID 48" in why
    # Another GPU's hits do not count; hits older than the window fall out.
    assert ledger.escalate(classify(gpu(48, index=1)), now + 10, limits)[0] == Rung.RESET
    assert ledger.escalate(finding, now + 25 * 3600, limits)[0] == Rung.RESET


def test_node_remediations_escalate_to_replace() -> None:
    limits = RepairThresholds(node_remediation_limit=3, node_remediation_window_seconds=100)
    ledger = Ledger()
    ledger.record_remediation(0)
    assert ledger.escalate(classify(gpu(48)), 1, limits)[0] == Rung.RESET
    ledger.record_remediation(1)
    assert ledger.escalate(classify(gpu(48)), 2, limits)[0] == Rung.REPLACE
    assert ledger.escalate(classify(gpu(48)), 150, limits)[0] == Rung.RESET, "old remediations expire"
    assert ledger.escalate(classify(gpu(13)), 2, limits)[0] is None


def test_fingerprint_ignores_temperature_noise_but_not_faults() -> None:
    a = fingerprint("boot", [gpu(temperature_c=40)])
    assert a == fingerprint("boot", [gpu(temperature_c=55)])
    assert a != fingerprint("boot", [gpu(temperature_c=91)])
    assert a != fingerprint("boot", [gpu(48)])
    assert a != fingerprint("other-boot", [gpu(temperature_c=40)])
