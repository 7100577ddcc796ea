"""EntityUpdate (any id without ``/``, e.g. ``update-quota-raised-lambda-main-1``): one
operator update relayed to an entity, for callers of Temporal's HTTP API.

That API cannot address an entity (its id travels in the URL path, and every entity
id contains ``/``), so the caller starts this workflow instead, naming the entity and
the update in the body. The runbook: check the request against the allow-list
(fleet/contracts/entity_update.py: a bad entity id, update or argument fails here,
``InvalidInput`` naming the field, before anything is sent) → send the update
(one activity, through the worker's own client) → the entity's answer is the result.
An update the entity refuses fails this workflow with the entity's reason; so does
an entity that does not exist or has closed. Nothing is retried that another try
cannot change, and a retried send attaches to the update already taken.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from fleet.contracts import activities as act
    from fleet.contracts.entity_update import EntityUpdateInput, EntityUpdateResult
    from workflows.inputs import parse_input
    from workflows.steps import STORE_RETRY, WAIT_HEARTBEAT, failure_message, failure_type, show_details

#: An update may run for minutes inside the entity (``credentials_rotated`` runs the deletes
#: queued while the account was revoked, up to 10 minutes); the heartbeat notices a lost worker.
UPDATE_TIMEOUT = timedelta(minutes=15)


@workflow.defn(name="EntityUpdate")
class EntityUpdate:
    @workflow.run
    async def run(self, raw: Any) -> EntityUpdateResult:
        request = parse_input(EntityUpdateInput, raw)
        what = f"`{request.update}` on `{request.entity}`"
        show_details("sending", detail=what)
        try:
            result: EntityUpdateResult = await workflow.execute_activity(
                act.relay_entity_update, request,
                start_to_close_timeout=UPDATE_TIMEOUT, heartbeat_timeout=WAIT_HEARTBEAT,
                retry_policy=STORE_RETRY, summary=f"{request.update} on {request.entity}",
            )
        except ActivityError as error:
            show_details("failed", detail=f"{what}: {failure_message(error)}")
            # Raised at the top: an HTTP caller reads the entity's reason as the failure's message.
            raise ApplicationError(failure_message(error), type=failure_type(error), non_retryable=True) from None
        show_details("done", detail=what)
        return result
