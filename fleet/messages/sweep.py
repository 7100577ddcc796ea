"""Inputs and results of FleetSweep (the leak sweep) and its activities."""

from __future__ import annotations

from pydantic import BaseModel, Field

from fleet.models import DAY, Strict


class FleetSweepInput(Strict):
    """FleetSweep takes nothing (or ``{}``) from its Schedule; by hand, optionally these."""

    #: Override ``sweep.grace_seconds`` of the config for this run (tests, a person in a hurry).
    grace_seconds: float | None = Field(None, ge=0, le=7 * DAY)
    #: Report what would be deleted, delete nothing.
    dry_run: bool = False


class SweepKnown(BaseModel):
    """What accounts for a machine: a node in the cluster its join identified (its identity
    record names the machine) and admitted, or a join still running."""

    node_names: list[str] = Field(default_factory=list)
    machine_ids: list[str] = Field(default_factory=list)
    #: Node names of running NodeJoins (their machines may not have registered yet).
    joining: list[str] = Field(default_factory=list)
    #: Nodes with no identity record: they account for no machine (a Node object is what any
    #: kubelet with a certificate can create, a retired one's included).
    unidentified: list[str] = Field(default_factory=list)
    #: Nodes still tainted unproven whose join no longer runs (terminated, timed out: a terminate
    #: runs no clean-up): nothing will admit them, and they account for no machine. Node name ->
    #: its site ("" where neither its identity record nor its labels say). The sweep deletes such a
    #: node's machine past the grace, then removes the Node and its identity record.
    abandoned: dict[str, str] = Field(default_factory=dict)


class SweepSiteInput(BaseModel):
    site: str
    known: SweepKnown
    grace_seconds: float | None = None
    dry_run: bool = False
    #: Machine id -> epoch seconds first seen, for providers that give no creation time
    #: (Lambda): carried from the previous sweep, so their age is counted from then.
    first_seen: dict[str, float] = Field(default_factory=dict)


class SiteSweepReport(BaseModel):
    site: str
    account: str = ""
    #: Why the site was not listed (credentials revoked: rule 6), or the error that stopped it.
    skipped: str = ""
    listed: int = 0
    #: Machines without the fleet's ownership marker: counted, never touched.
    unmarked: int = 0
    known: int = 0
    joining: int = 0
    #: Unaccounted for but younger than the grace period: looked at again next time.
    young: list[str] = Field(default_factory=list)
    deleted: list[str] = Field(default_factory=list)
    failed: list[str] = Field(default_factory=list)
    first_seen: dict[str, float] = Field(default_factory=dict)
    #: Nodes a join left unproven and no longer runs (``SweepKnown.abandoned``) removed, with their
    #: identity records, their machines deleted (in ``deleted``) or gone already.
    abandoned: list[str] = Field(default_factory=list)


class SweepIdentitiesInput(BaseModel):
    #: Node names of running NodeJoins (``SweepKnown.joining``): their records are in use.
    joining: list[str] = Field(default_factory=list)
    grace_seconds: float | None = None
    dry_run: bool = False
    #: Node name -> epoch seconds the previous sweep first saw its record without a Node.
    first_seen: dict[str, float] = Field(default_factory=dict)


class IdentitySweepReport(BaseModel):
    """Node identity records (the join's record of each node's machine) without a Node."""

    listed: int = 0
    #: Without a Node, but not for longer than the grace: looked at again next time.
    young: list[str] = Field(default_factory=list)
    deleted: list[str] = Field(default_factory=list)
    first_seen: dict[str, float] = Field(default_factory=dict)


class FleetSweepResult(BaseModel):
    sites: list[SiteSweepReport] = Field(default_factory=list)
    deleted: int = 0
    young: int = 0
    skipped: int = 0
    dry_run: bool = False
    #: None: a run from before the sweep looked at identity records.
    identities: IdentitySweepReport | None = None
