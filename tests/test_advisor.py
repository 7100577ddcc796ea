"""The advisor's counterfactual (fleet/advisor.py) on a small fleet computed by hand, and the
usage ledger it reads (activities/ledger.py) over the sim's cluster port."""

from __future__ import annotations

import pytest

from activities import ledger as ledger_module
from activities.ledger import USAGE_STATE, UsageLedger, value_key
from fleet.advisor import advise, period_hours, workload_constraints
from fleet.config import Site
from fleet.messages.advisor import AdvisorInput, LedgerEntry, Usage, Workload
from fleet.models import AccountState, CapacityType, Offer
from fleet.placement import AccountView, Constraints
from sim.cluster import SimCluster
from sim.world import SimWorld

H = 3600.0
START = 1_700_000_000.0
END = START + 10 * H


def site(name: str, geo: str, price: float, *, gpu: str = "H100", memory: int = 80, spot: bool = False,
         compliance: bool = False) -> Site:
    return Site(name=name, provider="lambda", account=f"acct-{name}", region="r", geography=geo, gpu=gpu,
                gpus_per_machine=8, gpu_memory_gb=memory, instance_type=f"{name}-8x", price_per_gpu_hour=price,
                capacity_type=CapacityType.SPOT if spot else CapacityType.ON_DEMAND, max_nodes=4,
                compliance=compliance)


SITES = [
    site("us-od", "us", 3.00),
    site("us-spot", "us", 1.50, spot=True),
    site("us-small", "us", 0.90, memory=40),
    site("us-a100", "us", 1.00, gpu="A100"),
    site("eu-od", "eu", 2.50),
    site("eu-spot", "eu", 1.00, spot=True),
    site("eu-c", "eu", 4.00, compliance=True),
]
RISK = {"us-spot": 0.2, "eu-spot": 0.5}


def offers(sites: list[Site] = SITES) -> list[Offer]:
    return [Offer(site=s.name, provider=s.provider, instance_type=s.instance_type, gpu=s.gpu, gpus=8,
                  gpu_memory_gb=s.gpu_memory_gb, price_per_gpu_hour=s.price_per_gpu_hour,
                  capacity_type=s.capacity_type, interruption_risk=RISK.get(s.name, 0.0))
            for s in sites]


def machine(mid: str, s: str, joined: float, retired: float | None = None, reclaimed: bool = False) -> LedgerEntry:
    where = next(x for x in SITES if x.name == s)
    return LedgerEntry(machine_id=mid, site=s, offer=where.instance_type, gpu=where.gpu, gpus=8,
                       gpu_memory_gb=where.gpu_memory_gb, price_per_gpu_hour=where.price_per_gpu_hour,
                       capacity_type=where.capacity_type, interruption_risk=RISK.get(s, 0.0), joined_at=joined,
                       retired_at=retired, reclaimed=reclaimed)


#: chat: 8 GPUs on-demand at us-od all 10 h (joined before the period) = 80 GPU-h x $3 = $240.
#: batch: us-spot, m2 for 4 h then reclaimed, m3 for the last 6 h = 80 GPU-h at $1.50 x 1.2 = $144,
#:   plus one reclaim (1 machine-hour: 8 x $1.50 = $12) = $156; measured rate 1 per 10 machine-hours.
#: eu-model: 8 GPUs at the compliance site eu-c, 10 h x $4 = $320.
USAGE = Usage(
    entries=[
        machine("m1", "us-od", START - 5 * H),
        machine("m2", "us-spot", START, START + 4 * H, reclaimed=True),
        machine("m3", "us-spot", START + 4 * H),
        machine("m4", "eu-c", START),
        machine("old", "us-od", START - 30 * H, START - 20 * H),  # before the period: not counted
    ],
    workloads=[
        Workload(model="chat", site="us-od", replicas=1, gpus_per_replica=8),
        Workload(model="batch", site="us-spot", replicas=2, gpus_per_replica=4),
        Workload(model="eu-model", site="eu-c", replicas=1, gpus_per_replica=8),
    ],
)
CONSTRAINTS = {
    "chat": Constraints(capacity_types=[CapacityType.ON_DEMAND]),
    # Asks for the US too: eu-c is a compliance site, so its geography wins.
    "eu-model": Constraints(geographies=["us", "eu"]),
}


def report(**kw):
    args = dict(start=START, end=END, since="10h", constraints=CONSTRAINTS, reclaim_cost_hours=1.0)
    return advise(USAGE, offers(), SITES, **{**args, **kw})


def test_a_hand_computed_fleet_gives_the_exact_figures() -> None:
    r = report()
    by = {w.model: w for w in r.workloads}
    assert r.hours == 10

    chat = by["chat"]  # no spot: the cheapest on-demand H100/80 GB is eu-od, 80 x $2.50
    assert (chat.gpu_hours, chat.now, chat.advised, chat.saving) == (80, 240.0, 200.0, 40.0)
    assert chat.advised_offer == "eu-od/eu-od-8x" and chat.current_offer == "us-od/us-od-8x"

    batch = by["batch"]  # eu-spot: 80 x $1.00 x (1 + 0.5) = $120, no reclaims measured there
    assert (batch.gpu_hours, batch.now, batch.advised, batch.saving) == (80, 156.0, 120.0, 36.0)
    assert batch.reclaims == 1 and batch.advised_offer == "eu-spot/eu-spot-8x"

    eu = by["eu-model"]
    assert (eu.gpu_hours, eu.now, eu.advised, eu.saving) == (80, 320.0, 120.0, 200.0)

    assert (r.now, r.advised, r.saving) == (716.0, 440.0, 276.0)
    rates = {s.site: (s.now_per_hour, s.advised_per_hour) for s in r.sites}
    assert rates == {"us-od": (24.0, 0.0), "us-spot": (15.6, 0.0), "eu-c": (32.0, 0.0),
                     "eu-od": (0.0, 20.0), "eu-spot": (0.0, 24.0)}
    assert "saving $276.00" in r.markdown and "| chat | us-od | 80.0 | $240.00 | $200.00 | $40.00 |" in r.markdown


def test_spot_is_priced_net_of_risk_and_measured_reclaims() -> None:
    """Only us-spot allowed for batch: 80 GPU-h x $1.50 x 1.2 = $144, plus the measured rate
    (1 reclaim per 10 machine-hours) over 10 machine-hours = 1 reclaim x 8 x $1.50 = $12."""
    only_us_spot = {"batch": Constraints(sites=["us-spot"])}
    batch = next(w for w in report(constraints=only_us_spot).workloads if w.model == "batch")
    assert batch.now == 156.0 and batch.advised == 156.0 and batch.saving == 0.0
    assert batch.advised_offer == batch.current_offer == "us-spot/us-spot-8x"
    assert batch.note == "already on the cheapest qualifying offer"
    # Two hours of reclaim cost per reclaim: now $144 + 2 x $12; the offer's expected reclaims the same.
    batch2 = next(w for w in report(constraints=only_us_spot, reclaim_cost_hours=2.0).workloads
                  if w.model == "batch")
    assert batch2.now == 168.0 and batch2.advised == 168.0


def test_constraints_hold_eu_only_never_in_the_us_no_spot_never_on_spot() -> None:
    by_site = {s.name: s for s in SITES}
    r = report()
    by = {w.model: w for w in r.workloads}
    eu = by["eu-model"]
    assert by_site[eu.advised_site].geography == "eu"
    assert any(x.startswith("us-od/") and "geography us not in eu" in x for x in eu.rejected)
    chat = by["chat"]
    assert by_site[chat.advised_site].capacity_type != CapacityType.SPOT
    assert "eu-spot/eu-spot-8x: spot not allowed" in chat.rejected
    assert any(x.startswith("us-small/") and "40 GB GPU memory < 80 GB" in x for x in chat.rejected)
    assert any(x.startswith("us-a100/") and "GPU A100 is not H100" in x for x in chat.rejected)
    # An EU-only request without compliance: same answer, never the cheaper US offers.
    eu_only = report(constraints={"chat": Constraints(geographies=["eu"], capacity_types=[CapacityType.ON_DEMAND]),
                                  "batch": Constraints(geographies=["eu"])})
    for w in eu_only.workloads:
        if w.model in ("chat", "batch", "eu-model"):
            assert by_site[w.advised_site].geography == "eu", w


def test_max_price_and_accounts_reject_with_reasons() -> None:
    """batch may pay at most $0.95/GPU-h list price: only us-small qualifies by price, but it is
    40 GB; nothing qualifies, it stays, and the reasons say why. A revoked account's offers go too."""
    r = report(constraints={"batch": Constraints(max_price_per_gpu_hour=0.95)})
    batch = next(w for w in r.workloads if w.model == "batch")
    assert batch.advised == batch.now and not batch.current_qualifies
    assert "eu-spot/eu-spot-8x: $1.00/GPU-h > max $0.95" in batch.rejected
    revoked = {"acct-eu-spot": AccountView(state=AccountState.CREDENTIALS_REVOKED)}
    batch = next(w for w in report(accounts=revoked).workloads if w.model == "batch")
    assert batch.advised_offer != "eu-spot/eu-spot-8x"
    assert any(x.startswith("eu-spot/") and "credentials revoked" in x for x in batch.rejected)


def test_a_site_that_serves_nothing_and_shared_sites() -> None:
    usage = Usage(entries=[machine("m1", "us-od", START)],
                  workloads=[Workload(model="a", site="us-od", replicas=1, gpus_per_replica=6),
                             Workload(model="b", site="us-od", replicas=1, gpus_per_replica=2)])
    r = advise(usage, offers(), SITES, start=START, end=END)
    assert [(w.model, w.gpu_hours, w.now) for w in r.workloads] == [("a", 60.0, 180.0), ("b", 20.0, 60.0)]
    idle = advise(Usage(entries=usage.entries), offers(), SITES, start=START, end=END)
    assert [(w.model, w.now) for w in idle.workloads] == [("(none)", 240.0)]


def test_workload_constraints_keep_compliance() -> None:
    eu_c = next(s for s in SITES if s.name == "eu-c")
    c = workload_constraints(eu_c, Constraints(geographies=["us"], gpu_class=["H100", "H200"]))
    assert c.geographies == ["eu"] and c.gpu is None and c.gpu_class == ["H100", "H200"]
    assert c.gpu_memory_gb_min == 80


def test_input_is_bounded() -> None:
    assert period_hours("7d") == 168 and period_hours("36h") == 36 and period_hours("2w") == 336
    for bad in ({"since": "7y"}, {"since": "0d"}, {"reclaim_cost_hours": 100}, {"nope": 1},
                {"constraints": {"m": {"spend_cap_per_hour": 3}}}):
        with pytest.raises(ValueError):
            AdvisorInput.model_validate(bad)


# -- the ledger ------------------------------------------------------------------------------
@pytest.fixture
def cluster(tmp_path) -> SimCluster:
    return SimCluster(SimWorld(tmp_path / "sim.db"))


def test_ledger_records_once_and_merges(cluster: SimCluster) -> None:
    ledger = UsageLedger(cluster)
    entry = machine("i-0abc", "us-spot", START)
    assert ledger.joined(entry) is True
    assert ledger.joined(entry.model_copy(update={"joined_at": START + 5})) is False  # a retried activity
    assert ledger.retired("us-spot", "i-0abc", reclaimed=True, at=START + 4 * H) is True
    assert ledger.retired("us-spot", "i-0abc", at=START + 4 * H + 9) is False
    [got] = ledger.entries()
    assert (got.joined_at, got.retired_at, got.reclaimed, got.price_per_gpu_hour) == (
        START, START + 4 * H, True, 1.50)
    # One object per site and month.
    assert list(cluster.list_state(USAGE_STATE)) == ["us-spot.2023-11"]


def test_ledger_keys_fit_a_configmap_and_spill(cluster: SimCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    assert value_key("rack1/slot 3", "joined").endswith(".joined")
    assert value_key("rack1/slot 3", "joined") != value_key("rack1_slot 3", "joined")
    monkeypatch.setattr(ledger_module, "MAX_OBJECT_BYTES", 1200)
    ledger = UsageLedger(cluster)
    for n in range(12):
        ledger.joined(machine(f"m{n}", "eu-od", START + n))
    ledger.joined(machine("m3", "eu-od", START + 99))  # already in the first shard: not again
    objects = cluster.list_state(USAGE_STATE)
    assert len(objects) > 1 and all(sum(len(k) + len(v) for k, v in d.items()) <= 1200 for d in objects.values())
    assert sorted(e.machine_id for e in ledger.entries()) == sorted(f"m{n}" for n in range(12))
    assert next(e for e in ledger.entries() if e.machine_id == "m3").joined_at == START + 3


def test_the_cli_prints_the_report_as_every_list_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpufleet advisor -o table|wide|json|tsv` like every other list, and `-o md` for the
    Markdown report; the old `--format` keeps working. The report is the hand-computed fleet's."""
    import json

    from typer.testing import CliRunner

    from cli import advisor as advisor_cli
    from cli.main import app

    computed = report()

    async def advise_here(config, request):
        return computed

    monkeypatch.setattr(advisor_cli, "_advise", advise_here)
    runner = CliRunner()

    def shown(*args: str):
        done = runner.invoke(app, ["advisor", *args], env={"COLUMNS": "80"})
        assert done.exit_code == 0, done.output
        return done

    header = "model\tsite\tGPU-h\tnow $\tadvised $\tsaving $\tadvised offer\tnote"
    tsv = shown("-o", "tsv")
    lines = tsv.stdout.splitlines()
    assert lines[0] == header and len(lines) == 1 + len(computed.workloads), tsv.stdout
    assert any(line.startswith("chat\tus-od\t80.0\t240.00\t200.00\t40.00\teu-od/eu-od-8x\t") for line in lines), lines
    assert "total: now $716.00, advised $440.00, saving $276.00" in tsv.stderr
    rows = json.loads(shown("-o", "json").stdout)
    assert rows["workloads"][0]["model"] and (rows["now"], rows["saving"]) == (716.0, 276.0)
    wide = shown("-o", "wide").stdout
    assert "advised offer" in wide and "eu-od/eu-od-8x" in wide and "total: now $716.00" in wide
    table = shown("-o", "table").stdout
    assert max(len(line) for line in table.splitlines()) <= 80, table
    assert shown("-o", "md").stdout.startswith("**Advisor, last")
    assert shown("--format", "md").stdout == shown("-o", "md").stdout
    assert json.loads(shown("--format", "json").stdout) == rows
    bad = runner.invoke(app, ["advisor", "-o", "xml"])
    said = " ".join(bad.output.replace("│", " ").split())  # rich boxes and wraps the error
    assert bad.exit_code == 2 and "must be one of table, wide, json, tsv, md, not 'xml'" in said, bad.output
