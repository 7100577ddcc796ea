"""What the operator reads: one prefix per cause, no library URLs, plain lines when piped,
JSON on request, and `config check` naming every problem in one pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from cli.common import human
from fleet.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_one_prefix_per_cause_and_no_pydantic_url() -> None:
    assert human("InvalidRequest: InvalidRequest: InvalidRequest while resolving site: InvalidRequest: site: unknown "
                 "site 'x'", "InvalidRequest") == "InvalidRequest while resolving site: site: unknown site 'x'"
    assert human("OverQuota: OverQuota: account blocked", "OverQuota") == "OverQuota: account blocked"
    assert human("no capacity left", "NoCapacity") == "NoCapacity: no capacity left"
    text = human("count\n  Input should be a valid integer [type=int_parsing]\n"
                 "    For further information visit https://errors.pydantic.dev/2.11/v/int_parsing")
    assert "pydantic.dev" not in text and "valid integer" in text


def test_config_check_reports_field_and_cross_field_problems_in_one_pass() -> None:
    raw = {"accounts": [{"name": "a", "provider": "lambda"}, {"name": "a", "provider": "lambda"}],
           "sites": [
               {"name": "s", "provider": "lambda", "account": "a", "region": "r", "gpu": "H100",
                "gpus_per_machine": "eight", "instance_type": "t", "price_per_gpu_hour": 1, "min_nodes": 5,
                "max_nodes": 2},
               {"name": "s", "provider": "lambda", "account": "nobody", "region": "r", "gpu": "H100",
                "gpus_per_machine": 8, "instance_type": "t", "price_per_gpu_hour": 1, "max_nodes": 2},
           ]}
    try:
        parse_config(raw)
    except ConfigError as error:
        problems = "\n".join(error.problems)
    else:
        raise AssertionError("accepted")
    assert "gpus_per_machine" in problems                      # a field error ...
    assert "min_nodes (5) is greater than max_nodes (2)" in problems  # ... and, in the same pass,
    assert "duplicate site" in problems and "duplicate account" in problems
    assert "unknown account reference 'nobody'" in problems


def test_lists_are_plain_lines_when_piped_and_json_on_request(tmp_path: Path) -> None:
    env = {"GPUFLEET_STATE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "COLUMNS": "80"}
    piped = subprocess.run([sys.executable, "-m", "cli", "sites"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert piped.returncode == 0, piped.stderr
    lines = piped.stdout.splitlines()
    assert lines[0].split("\t")[:2] == ["site", "provider"] and "…" not in piped.stdout and "│" not in piped.stdout
    assert piped.stdout.endswith("\n")
    as_json = subprocess.run([sys.executable, "-m", "cli", "sites", "--output", "json"], env=env, cwd=ROOT,
                             capture_output=True, text=True)
    sites = json.loads(as_json.stdout)
    assert {s["site"] for s in sites} >= {"lambda-us-east", "own-dc-ber"} and sites[0]["reachable"] == "yes"


def test_builtin_fleet_names_the_demo_source_and_a_store_per_site() -> None:
    config = parse_config(yaml.safe_load((ROOT / "fleet" / "default_sites.yaml").read_text()))
    assert "demo-weights" in config.object_stores
    assert all(site.object_store is not None for site in config.sites)


def test_demo_manifest_matches_the_seeded_demo_model() -> None:
    import hashlib

    from cli.dev import DEMO_PREFIX, demo_model

    manifest = yaml.safe_load((ROOT / "deploy" / "rollout.demo.yaml").read_text())
    assert manifest["weights"]["source"] == {"store": "demo-weights", "prefix": DEMO_PREFIX}
    files = demo_model()
    assert {f["path"]: (f["size"], f["sha256"]) for f in manifest["weights"]["files"]} == {
        path: (len(data), hashlib.sha256(data).hexdigest()) for path, data in files.items()}


class _Fleet:
    """A FleetClient stand-in answering one call with a fixed state: what the command prints of it."""

    def __init__(self, **answers) -> None:
        for name, answer in answers.items():
            async def answer_(*_args, answer=answer):
                return answer
            setattr(self, name, answer_)


def test_repair_skip_to_says_where_the_ladder_goes_next(monkeypatch) -> None:
    """`gpufleet repair skip-to N G replace` on a held repair (the GpufleetRepairStuckOnRung runbook,
    step 4): the workflow took the skip, but the command printed the ladder as before (rung reboot,
    held, the same attempts), so it read as not taken. It says where the ladder goes next, and when."""
    from datetime import datetime, timezone

    from typer.testing import CliRunner

    import cli.repair
    from cli.main import app
    from fleet.messages.repair import Attempt, LadderState
    from fleet.repair_policy import Rung

    started = datetime(2026, 12, 7, 3, 0, tzinfo=timezone.utc)
    ladder = LadderState(node_name="n1", gpu=4, rung=Rung.REBOOT, step="recovering", held=True, skip_to=Rung.REPLACE,
                         reasons=["XID 48"], attempts=[Attempt(rung=Rung.RESET, started_at=started, outcome="failed"),
                                                       Attempt(rung=Rung.REBOOT, started_at=started)])
    monkeypatch.setattr(cli.repair, "_fleet", lambda address: _Fleet(skip_repair_to=ladder, repair_ladder=ladder))
    for command in (["repair", "skip-to", "n1", "4", "replace"], ["repair", "show", "n1", "4"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 0, result.output
        assert ("next: rung replace (an operator's skip-to), unless the reboot it is on proves the GPU; once released"
                in " ".join(result.output.split())), result.output
    released = ladder.model_copy(update={"held": False})
    monkeypatch.setattr(cli.repair, "_fleet", lambda address: _Fleet(repair_ladder=released))
    shown = " ".join(CliRunner().invoke(app, ["repair", "show", "n1", "4"]).output.split())
    assert "next: rung replace (an operator's skip-to), unless the reboot it is on proves the GPU" in shown
    assert "once released" not in shown
    taken = ladder.model_copy(update={"held": False, "skip_to": None, "rung": Rung.REPLACE})  # acted on: no line
    monkeypatch.setattr(cli.repair, "_fleet", lambda address: _Fleet(repair_ladder=taken))
    assert "next:" not in CliRunner().invoke(app, ["repair", "show", "n1", "4"]).output


def test_a_rollout_aborted_while_paused_is_not_shown_paused(monkeypatch) -> None:
    """`gpufleet rollout abort` of a paused rollout: `rollout status` said "aborted (paused)" (and
    "paused (paused)" while it was paused), the word a 3 am operator reads as a rollout `resume` goes
    on with. "(paused)" is said only beside a phase a pause holds."""
    from typer.testing import CliRunner

    import cli.rollout
    from cli.main import app
    from client.fleet import RolloutStatus
    from fleet.rollout import RolloutProgress, SiteProgress, render_details

    def status_of(phase: str) -> str:
        progress = RolloutProgress(rollout_id="rollout/m/v2", model="m", version="v2", phase=phase, paused=True,
                                   batch=1, batches=2, sites=[SiteProgress(site="site-a", replicas=1, canary=True)])
        monkeypatch.setattr(cli.rollout, "fleet_client", lambda settings: _Fleet(
            rollout_status=RolloutStatus("rollout/m/v2", None, progress, {})))
        result = CliRunner().invoke(app, ["rollout", "status", "rollout/m/v2"])
        assert result.exit_code == 0, result.output
        assert render_details(progress).splitlines()[0].startswith(f"**{phase}**")
        return result.output.splitlines()[0] + " | " + render_details(progress).splitlines()[0]

    for phase in ("aborted", "aborting", "cancelled", "failed", "completed", "paused"):
        assert "(paused)" not in status_of(phase), phase
    assert status_of("canary") == "rollout/m/v2: canary (paused), batch 1/2 | **canary** (paused) - batch 1 of 2"
