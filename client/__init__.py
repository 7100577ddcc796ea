"""Start and steer gpufleet from code: one async call per operator action.

    from client import FleetClient
    from fleet.messages.join import NodeJoinInput

    fleet = FleetClient()                      # TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, GPUFLEET_*
    join = await fleet.start_join(NodeJoinInput(site="lambda-us-east"), request="ci-42")
    result = await join.result()               # NodeJoinResult

Every call takes and returns the pydantic models the workflows use, starts
workflows under gpufleet's standard ids (a repeated call attaches to the running
one), and refuses a bad argument with :class:`InvalidArgument` naming the field
before anything is started. ``gpufleet`` (cli/) is built on this client.
"""

from client.errors import (
    FleetClientError, InvalidArgument, NoWorker, NotFound, Rejected, Unreachable, UpdateNotTaken, UpdateUnanswered,
)
from client.fleet import FleetClient, Renewed, RolloutStatus, manual_evacuation_id, query_workflow

__all__ = [
    "FleetClient",
    "FleetClientError",
    "InvalidArgument",
    "NoWorker",
    "NotFound",
    "Rejected",
    "Renewed",
    "RolloutStatus",
    "Unreachable",
    "UpdateNotTaken",
    "UpdateUnanswered",
    "manual_evacuation_id",
    "query_workflow",
]
