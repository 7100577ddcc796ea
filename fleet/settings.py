"""Where things are: Temporal address, namespace, task queue, state dir, config.

Every entry point reads the same environment variables so that ``gpufleet dev``
can hand its children one environment.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

#: The control-plane worker's task queue.
CONTROL_PLANE_QUEUE = "gpufleet"


def node_queue(node_name: str) -> str:
    """The task queue a node's agent polls."""
    return f"node/{node_name}"


class Settings(BaseModel):
    address: str = "localhost:7233"
    namespace: str = "default"
    task_queue: str = CONTROL_PLANE_QUEUE
    state_dir: Path = Path(".gpufleet")
    config: str | None = None

    @classmethod
    def from_env(cls, **overrides: object) -> "Settings":
        env = {
            "address": os.environ.get("TEMPORAL_ADDRESS"),
            "namespace": os.environ.get("TEMPORAL_NAMESPACE"),
            "task_queue": os.environ.get("GPUFLEET_TASK_QUEUE"),
            "state_dir": os.environ.get("GPUFLEET_STATE_DIR"),
            "config": os.environ.get("GPUFLEET_CONFIG"),
        }
        values = {k: v for k, v in env.items() if v}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def sim_db(self) -> Path:
        return self.state_dir / "sim.db"

    def env(self) -> dict[str, str]:
        """The environment a child process needs to see the same world."""
        env = {
            "TEMPORAL_ADDRESS": self.address,
            "TEMPORAL_NAMESPACE": self.namespace,
            "GPUFLEET_TASK_QUEUE": self.task_queue,
            "GPUFLEET_STATE_DIR": str(self.state_dir),
        }
        if self.config:
            env["GPUFLEET_CONFIG"] = self.config
        return env
