"""EntityUpdate's one activity: send an operator update to an entity and return its result.

It uses the worker's own Temporal client (``activity.client()``), names the entity's
workflow only by id and type name (activities never import workflows), and turns
every answer that another attempt cannot change into a non-retryable failure that
says what happened: no such entity, not the kind the id promises, closed, or the
entity refused the update (its validator's reason).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError, FailureError
from temporalio.service import RPCError, RPCStatusCode

from fleet.contracts.entity_update import EntityUpdateInput, EntityUpdateResult

#: Well inside the workflow's heartbeat timeout: an update can run for minutes
#: (``credentials_rotated`` runs the deletes queued while the account was revoked).
HEARTBEAT_EVERY = timedelta(seconds=10)


def _final(message: str, type: str, **details: str) -> ApplicationError:
    return ApplicationError(message, *([details] if details else []), type=type, non_retryable=True)


def update_id() -> str:
    """The same for every attempt of this relay run: a retried attempt attaches to the update
    the entity already took instead of applying it twice."""
    info = activity.info()
    return f"relay/{info.workflow_id}/{info.workflow_run_id}"


class EntityUpdateActivities:
    def all(self) -> list:
        return [self.relay_entity_update]

    @activity.defn
    async def relay_entity_update(self, input: EntityUpdateInput) -> EntityUpdateResult:
        kind = input.kind
        handle = activity.client().get_workflow_handle(input.entity)
        try:
            described = await handle.describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise _final(f"no entity {input.entity}: no workflow has that id (a {kind.workflow_type} "
                             f"entity starts with its first event)", "EntityNotFound") from None
            raise
        if described.workflow_type != kind.workflow_type:
            raise _final(f"{input.entity} is a {described.workflow_type}, not a {kind.workflow_type}",
                         "EntityNotFound")
        if described.status != WorkflowExecutionStatus.RUNNING:
            state = described.status.name.lower() if described.status else "closed"
            raise _final(f"{input.entity} is {state}: a closed {kind.workflow_type} takes no updates",
                         "EntityClosed")

        beat = asyncio.create_task(self._heartbeat())
        try:
            # Not pinned to the run just described: entities continue as new, and the update
            # belongs to whichever run of the entity is current when it arrives.
            result = await handle.execute_update(
                input.update, args=input.wire_args(), id=update_id(),
            )
        except WorkflowUpdateFailedError as error:
            cause = error.cause
            reason = cause.message if isinstance(cause, FailureError) else str(cause)
            cause_type = cause.type if isinstance(cause, ApplicationError) and cause.type else type(cause).__name__
            raise _final(f"{input.entity} refused {input.update}: {reason}", "UpdateRejected",
                         entity_error=cause_type) from None
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:  # it closed after the describe
                raise _final(f"{input.entity} closed before it took {input.update}: {error.message}",
                             "EntityClosed") from None
            raise
        finally:
            beat.cancel()
        return EntityUpdateResult(entity=input.entity, update=input.update, workflow_type=kind.workflow_type,
                                  result=result)

    @staticmethod
    async def _heartbeat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_EVERY.total_seconds())
