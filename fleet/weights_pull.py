"""What a serving pod's init step needs to put verified weights on its node (pure).

The init container (``python -m workers.weights_pull``, in the node-agent image)
copies one model version from its site's object store into a node-local cache
shared by every replica on the node, checking each file's sha256 against the
rollout manifest; the model server reads only that cache. This module holds the
description it is given (rendered into the pod as ``GPUFLEET_WEIGHTS``) and the
cache layout; ``workers/weights_pull.py`` does the copying.
"""

from __future__ import annotations

from pydantic import Field

from fleet.config import ObjectStore
from fleet.models import Strict
from fleet.rollout import NAME, WeightFile
from fleet.settings import WEIGHTS_KEY_ENV, WeightsPullEnv

#: The node-local cache (a hostPath shared by the replicas on one node).
CACHE_ROOT = "/var/cache/gpufleet/models"
#: The pod's environment variable that carries a ``WeightsPull`` as JSON.
ENV = WeightsPullEnv.variable("weights")
#: Where an init container reads the store's key when the store's credentials are a
#: Kubernetes Secret (mounted into the pod as this variable, never written into the spec).
KEY_ENV = WEIGHTS_KEY_ENV
#: The image that carries ``workers.weights_pull`` (deploy/containers/Containerfile.node-agent).
DEFAULT_IMAGE = "gpufleet-node-agent:latest"


class WeightsPull(Strict):
    model: str = Field(min_length=1, max_length=128, pattern=NAME)
    version: str = Field(min_length=1, max_length=128, pattern=NAME)
    #: The site's store; its ``credentials`` as the pod sees them (``env`` ``KEY_ENV``) or none
    #: (the node's own role).
    store: ObjectStore
    #: Key prefix of this version inside the bucket (``RolloutInput.dest_prefix``).
    prefix: str = Field("", max_length=1024)
    files: list[WeightFile] = Field(min_length=1, max_length=100_000)
    image: str = DEFAULT_IMAGE

    def cache_dir(self, root: str = CACHE_ROOT) -> str:
        return f"{root.rstrip('/')}/{self.model}/{self.version}"
