"""The node agent's real GPU backend (NVML + the CUDA driver API) on a machine with GPUs.

Skipped where no NVIDIA driver answers (CI, laptops); run on a GPU node with
``python -m pytest tests/test_gpu_real.py``. Everything here is what a real node's
health report is built from, so a driver or NVML change that breaks the probe shows
up here before a fleet of nodes starts reporting themselves unhealthy.
"""

from __future__ import annotations

import pytest

from fleet.repair_policy import classify, conditions, fingerprint


def _nvml_devices() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:  # noqa: BLE001 - no library, no driver, no device: nothing to test here
        return 0


pytestmark = pytest.mark.skipif(_nvml_devices() == 0, reason="no NVIDIA GPU answers NVML here")


@pytest.fixture(scope="module")
def backend():
    from providers.gpu import NvmlBackend

    return NvmlBackend()


def test_a_healthy_gpu_probes_with_its_identity_and_classifies_healthy(backend) -> None:
    report = backend.probe()
    assert len(report) == _nvml_devices()
    for health in report:
        assert health.uuid.startswith("GPU-"), health.uuid
        assert health.name, "NVML names the product (placement matches on it)"
        assert health.memory_gb > 1
        assert 0 < health.temperature_c < (health.slowdown_temperature_c or 120)
        assert not health.lost and health.ecc_uncorrected == 0 and not health.remapped_rows_failure
        # The repair ladder acts on nothing: a healthy GPU raises no condition.
        assert conditions(health) == {}, conditions(health)
        assert classify(health).rung is None, classify(health)


def test_the_report_fingerprint_is_stable_between_probes_of_an_idle_gpu(backend) -> None:
    boot = backend.boot_id()
    assert len(boot) == 36  # a UUID: changes on every boot, proves a reboot happened
    first, second = backend.probe(), backend.probe()
    # Temperatures move; identity and faults do not, so the fingerprint only moves on a change that matters.
    assert [g.uuid for g in first] == [g.uuid for g in second]
    assert fingerprint(boot, first) == fingerprint(boot, second)


def test_the_compute_check_passes_on_a_real_gpu_and_fails_on_a_missing_one(backend) -> None:
    for index in range(_nvml_devices()):
        assert backend.compute_check(index) is None
    missing = backend.compute_check(_nvml_devices() + 7)
    assert missing is not None and "cuDeviceGet" in missing, missing


def test_the_xid_waiter_starts_and_a_quiet_gpu_reports_no_xid(backend) -> None:
    backend.watch_xids()
    assert all(health.xid_events == [] for health in backend.probe())
