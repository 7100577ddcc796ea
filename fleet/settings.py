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


def temporal_profile():
    """The Temporal client profile as the ``temporal`` CLI would load it: ``temporal.toml``
    (``TEMPORAL_CONFIG_FILE``, profile ``TEMPORAL_PROFILE``) under the ``TEMPORAL_*``
    variables (address, namespace, API key, ``TEMPORAL_TLS_*``)."""
    from temporalio.envconfig import ClientConfigProfile

    try:
        return ClientConfigProfile.load()
    except Exception as error:  # the bridge's ConfigError: a bad file or an unknown profile
        raise ValueError(f"Temporal environment configuration (TEMPORAL_PROFILE / temporal.toml): {error}") from None


class Settings(BaseModel):
    address: str = "localhost:7233"
    namespace: str = "default"
    task_queue: str = CONTROL_PLANE_QUEUE
    state_dir: Path = Path(".gpufleet")
    config: str | None = None

    @classmethod
    def from_env(cls, **overrides: object) -> "Settings":
        profile = temporal_profile()
        env = {
            # Temporal's own environment configuration: TEMPORAL_ADDRESS / TEMPORAL_NAMESPACE,
            # else the profile (TEMPORAL_PROFILE) of temporal.toml (TEMPORAL_CONFIG_FILE).
            "address": profile.address,
            "namespace": profile.namespace,
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
