"""Every workflow type, signal, update and query, declared once by the name Temporal routes by.

Each name is a ``str`` (so it goes wherever the SDK takes a name: ``start_workflow``,
``signal``, ``query``, ``execute_update``, an external handle's ``signal``) that also says what
it is and which workflow type answers it. Code below the workflows (activities, the gateway)
cannot import the workflow classes, and a workflow that names another (Node and GpuRepair
signal each other) would make a circle: so every caller names them from here, and
``tests/test_registration.py`` checks that this list and the registered workflows' handlers
are the same, name for name. Workflow ids and task queues: ``fleet/naming.py``.
"""

from __future__ import annotations

from typing import Any


class Name(str):
    """A name Temporal routes by. ``kind``: workflow, signal, update or query; ``of``: the
    workflow type that answers it (for a workflow, itself)."""

    kind: str
    of: str

    def __new__(cls, name: str, *, kind: str, of: str) -> "Name":
        made = super().__new__(cls, name)
        made.kind, made.of = kind, of
        return made


class _Handler:
    """A handler declared by its attribute's name; ``Workflow`` makes it a ``Name``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __str__(self) -> str:
        # Only a mixin's own (``Entity.renew``) is left one: the SDK takes whatever is not callable
        # by ``str()``, and would send a signal named after this object that no handler answers.
        raise TypeError(f"a {self.kind} declared on a mixin names no workflow type: use it through one "
                        "(flows.Node.renew, not flows.Entity.renew)")


def Signal() -> Any:
    return _Handler("signal")


def Update() -> Any:
    return _Handler("update")


def Query() -> Any:
    return _Handler("query")


class Workflow:
    """One workflow type: ``class Node(Workflow, name="Node")``, its handlers as attributes
    (``quarantine = Signal()``), each of which becomes the ``Name`` of the same spelling;
    ``TYPE`` is the type's own name."""

    TYPE: Name

    def __init_subclass__(cls, *, name: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TYPE = Name(name, kind="workflow", of=name)
        # Inherited too: the handlers every entity answers are declared once, in ``Entity``.
        for attribute in dir(cls):
            if isinstance(value := getattr(cls, attribute), _Handler):
                setattr(cls, attribute, Name(attribute, kind=value.kind, of=name))


class Entity:
    """What every entity answers (``workflows/entity.py``, ``Entity``): ``class Node(Entity,
    Workflow, name="Node")``."""

    #: Continue as new at the next safe point, as on the server's suggestion
    #: (``gpufleet patches renew``: the runs from before a deploy move on to its code).
    renew: Name = Signal()



class NodeJoin(Workflow, name="NodeJoin"):
    """``workflows/node_join.py``, ``NodeJoin``."""

    progress: Name = Query()


class AcquireCapacity(Workflow, name="AcquireCapacity"):
    """``workflows/capacity.py``, ``AcquireCapacity``."""

    offers_changed: Name = Signal()
    stop: Name = Signal()
    cancel: Name = Update()
    progress: Name = Query()


class CatalogRefresh(Workflow, name="CatalogRefresh"):
    """``workflows/capacity.py``, ``CatalogRefresh``."""


class ProviderAccount(Entity, Workflow, name="ProviderAccount"):
    """``workflows/account.py``, ``ProviderAccount``."""

    report: Name = Signal()
    credentials_rotated: Name = Update()
    quota_raised: Name = Update()
    status: Name = Query()


class Site(Entity, Workflow, name="Site"):
    """``workflows/site.py``, ``SiteEntity``."""

    node_transition: Name = Signal()
    reconcile: Name = Signal()
    admit_repair: Name = Update()
    reconcile_now: Name = Update()
    status: Name = Query()


class SiteSweep(Workflow, name="SiteSweep"):
    """``workflows/site.py``, ``SiteSweep``."""


class SpotReclaim(Workflow, name="SpotReclaim"):
    """``workflows/reclaim.py``, ``SpotReclaim``."""

    notice: Name = Signal()
    step: Name = Query()


class Node(Entity, Workflow, name="Node"):
    """``workflows/node.py``, ``NodeEntity``."""

    cluster_state: Name = Signal()
    health_report: Name = Signal()
    incident_closed: Name = Signal()
    node_action_done: Name = Signal()
    node_action_request: Name = Signal()
    quarantine: Name = Signal()
    repair_gpu: Name = Update()
    return_gpu: Name = Update()
    status: Name = Query()


class GpuRepair(Workflow, name="GpuRepair"):
    """``workflows/repair.py``, ``GpuRepair``."""

    node_action_grant: Name = Signal()
    node_action_wait: Name = Signal()
    hold: Name = Update()
    release: Name = Update()
    skip_to: Name = Update()
    ladder: Name = Query()


class ModelRollout(Workflow, name="ModelRollout"):
    """``workflows/rollout.py``, ``ModelRollout``."""

    abort: Name = Update()
    pause: Name = Update()
    resume: Name = Update()
    progress: Name = Query()


class SiteEvacuation(Workflow, name="SiteEvacuation"):
    """``workflows/evacuation.py``, ``SiteEvacuation``."""

    retry: Name = Signal()
    abort: Name = Update()
    declare_recovered: Name = Update()
    look_again: Name = Update()
    progress: Name = Query()
    leftovers: Name = Query()


class FleetSweep(Workflow, name="FleetSweep"):
    """``workflows/sweep.py``, ``FleetSweep``."""


class Advisor(Workflow, name="Advisor"):
    """``workflows/advisor.py``, ``Advisor``."""

    step: Name = Query()


class Routing(Entity, Workflow, name="Routing"):
    """``workflows/routing.py``, ``RoutingEntity``."""

    site_event: Name = Signal()
    document: Name = Query()
    progress: Name = Query()


class Demand(Entity, Workflow, name="Demand"):
    """``workflows/demand.py``, ``Demand``."""

    status: Name = Query()


class EntityUpdate(Workflow, name="EntityUpdate"):
    """``workflows/entity_update.py``, ``EntityUpdate``."""


class CsrApprover(Workflow, name="CsrApprover"):
    """``workflows/csr_approver.py``, ``CsrApprover``."""


#: Every entity type by its name: the long-lived workflows that continue as new (their runs from
#: before a deploy move on when asked to ``renew``); every other type's runs end by themselves.
ENTITIES: dict[str, type[Workflow]] = {
    cls.TYPE: cls for cls in Workflow.__subclasses__() if issubclass(cls, Entity)}
