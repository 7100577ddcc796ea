"""What the client raises: one base class, each kind a caller may want to handle."""

from __future__ import annotations

from pydantic import ValidationError


class FleetClientError(Exception):
    """Base of every error the gpufleet client raises itself."""


class InvalidArgument(FleetClientError, ValueError):
    """A bad argument, refused before anything was started or sent.

    ``field`` is the first offending field as a dotted path (``count``,
    ``constraints.gpu``, ``sites.0.replicas``; ``(input)`` for the whole value),
    ``problems`` every ``(field, message)`` pair.
    """

    def __init__(self, problems: list[tuple[str, str]], what: str = "") -> None:
        self.problems = problems
        self.field = problems[0][0]
        self.what = what
        text = "; ".join(f"{field}: {message}" for field, message in problems)
        super().__init__(f"invalid {what}: {text}" if what else text)

    @classmethod
    def of(cls, error: ValidationError, what: str = "") -> "InvalidArgument":
        problems = []
        for problem in error.errors():
            field = ".".join(str(p) for p in problem["loc"]) or "(input)"
            message = "unknown field" if problem["type"] == "extra_forbidden" else problem["msg"]
            problems.append((field, message.removeprefix("Value error, ")))
        return cls(problems, what)


class Unreachable(FleetClientError, ConnectionError):
    """Temporal did not answer at the configured address."""

    def __init__(self, address: str, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(f"cannot reach Temporal at {address} ({reason})")


class NotFound(FleetClientError, LookupError):
    """No such workflow (or no running one where a running one is needed)."""

    def __init__(self, workflow_id: str, detail: str = "") -> None:
        self.workflow_id = workflow_id
        super().__init__(detail or f"{workflow_id}: no such workflow")


class Rejected(FleetClientError):
    """The workflow refused an update (its validator, or the handler failed); ``reason`` says why."""

    def __init__(self, workflow_id: str, update: str, reason: str) -> None:
        self.workflow_id = workflow_id
        self.update = update
        self.reason = reason
        super().__init__(reason)


class NoWorker(FleetClientError, TimeoutError):
    """No worker answered a query in time: a workflow's queries are answered by a worker polling
    its task queue (the control plane's), so its worker is down, not started, or too busy to
    answer. The message says which query, how long it waited, and where to look."""

    def __init__(self, workflow_id: str, query: str, task_queue: str, seconds: float) -> None:
        self.workflow_id = workflow_id
        self.query = query
        self.task_queue = task_queue
        self.seconds = seconds
        super().__init__(f"no worker answered `{query}` of `{workflow_id}` within {seconds:g} s: is the control "
                         f"plane running (its worker polls `{task_queue}`)? (gpufleet dev / kubectl -n gpufleet get pods)")


class UpdateNotTaken(NoWorker):
    """No worker took an update in time: an update is accepted (its validator run) by a worker
    polling the workflow's task queue, so with the control plane down it waited for ever. Not
    applied when raised; the server keeps it for a while, so a worker that comes back soon may
    still take it: the message says to look before sending it again."""

    def __init__(self, workflow_id: str, update: str, task_queue: str, seconds: float) -> None:
        super().__init__(workflow_id, update, task_queue, seconds)
        self.update = update
        self.args = (f"no worker took the update `{update}` of `{workflow_id}` within {seconds:g} s: is the "
                     f"control plane running (its worker polls `{task_queue}`)? (gpufleet dev / kubectl -n gpufleet "
                     "get pods); it is not applied, but the server may still hand it to a worker that starts soon: "
                     "look at the workflow before sending it again",)


class UpdateUnanswered(FleetClientError, TimeoutError):
    """A worker took an update (the workflow accepted it: it is in the workflow's history) but no
    answer came in time: the worker stopped as it ran the handler (the next one to poll the queue
    carries it on), or the handler itself waits long (a capacity cancel waits for its joins to
    stop). Either way the workflow carries it out whether or not anyone waits: the message says so,
    that it must not be sent again, and how to look (``temporal workflow update describe`` with its
    update id, and ``look``, a gpufleet command showing the workflow, where one does)."""

    def __init__(self, workflow_id: str, update: str, update_id: str, seconds: float, look: str = "") -> None:
        self.workflow_id = workflow_id
        self.update = update
        self.update_id = update_id
        self.seconds = seconds
        self.look = look
        shown = f" or `{look}`" if look else ""
        super().__init__(
            f"`{workflow_id}` accepted the update `{update}` but gave no answer within {seconds:g} s: it is "
            "in the workflow's history and goes on there (its worker may have stopped as it ran it: the next "
            "worker to poll the queue carries it on; or it waits on something slow), so do not send it again; "
            f"look: `temporal workflow update describe --workflow-id {workflow_id} --update-id {update_id}`{shown}")
