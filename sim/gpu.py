"""``SimGpuBackend``: a simulated machine's GPUs as its node agent sees them (the
``GpuBackend`` of ``providers/gpu.py``), with the faults ``gpufleet sim fault`` injects."""

from __future__ import annotations

from fleet.models import GpuHealth
from sim.world import SimWorld


class SimGpuBackend:
    """A simulated machine's GPUs as its node agent sees them."""

    def __init__(self, world: SimWorld, machine_id: str) -> None:
        self.world = world
        self.machine_id = machine_id

    def boot_id(self) -> str:
        row = self.world.machine(self.machine_id)
        return row["boot_id"] if row else ""

    def probe(self) -> list[GpuHealth]:
        return self.world.gpu_health(self.machine_id)

    def compute_check(self, index: int) -> str | None:
        return None if self.world.compute_ok(self.machine_id, index) else f"GPU {index}: compute check produced wrong results"

    def reset_gpu(self, index: int) -> str:
        """``nvidia-smi -r -i N``, simulated: refused while processes hold the GPU."""
        if self.world.gpu_held(self.machine_id, index):
            raise RuntimeError(f"GPU {index}: reset refused, processes still hold the GPU")
        cleared = self.world.clear_faults(self.machine_id, "reset", index)
        with self.world.tx() as db:
            self.world.record_action(db, self.machine_id, "gpu_reset", index)
        return f"GPU {index} reset ({cleared} simulated faults cleared)"

    def reinstall_driver(self) -> str:
        """Driver reinstall, simulated: clears what a reinstall clears, boot id unchanged."""
        cleared = self.world.clear_faults(self.machine_id, "reinstall")
        with self.world.tx() as db:
            self.world.record_action(db, self.machine_id, "driver_reinstall")
        return f"driver reinstalled ({cleared} simulated faults cleared)"
