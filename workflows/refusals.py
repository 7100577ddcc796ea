"""An update refused because of the entity's state, not because of its input.

Bad input is ``InvalidInput`` naming the field (``workflows.inputs.invalid_input``): the
caller must change what it sends. A refusal raised here says the input was fine but the
entity cannot take it now (nothing is blocked, the evacuation has ended, the rollout is not
paused): the caller must look at the entity, not its payload. Both are non-retryable: the
same update sent again is refused again until someone changes something. A plain
``ValueError`` from a validator reaches the caller as a retryable ``ValueError``, which says
neither.
"""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

#: The failure type of every refusal for the entity's state.
WRONG_STATE = "WrongState"


def wrong_state(message: str, state: str = "") -> ApplicationError:
    """``message`` says what the entity is doing instead; ``state`` (in the details) names it."""
    return ApplicationError(message, {"state": state}, type=WRONG_STATE, non_retryable=True)
