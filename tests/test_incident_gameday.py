"""``gpufleet gameday provider-loss`` against a running (test) stack: it breaks the
site, watches the evacuation through to the restore, and prints the durations."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from tests.evacuation_helpers import open_incident_stack


async def test_gameday_provider_loss_measures_the_timeline(temporal_env, tmp_path) -> None:
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        a = inc.site("a")
        await inc.join("a", 3)
        await inc.join("d", 1)
        inc.serve("llm", "a", replicas=1)
        inc.serve("llm", "d", replicas=0)
        out = tmp_path / "gameday.json"
        env = {**os.environ, **inc.settings.env()}
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "cli", "gameday", "provider-loss", "--site", a, "--heal-after", "0.2",
             "--timeout", "90", "--json", str(out)],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "measured durations" in proc.stdout
        report = json.loads(out.read_text())
        marks = report["sites"][a]["seconds_after_break"]
        assert report["sites"][a]["outcome"] == "restored"
        order = ["detected", "weight 0", "replicas ready elsewhere", "drained", "recovered", "restored"]
        assert [m for m in order if m in marks] == order
        assert [marks[m] for m in order] == sorted(marks[m] for m in order)
        assert inc.world.site_row(a)["unreachable"] == 0


async def test_gameday_region_loss_evacuates_every_site_of_the_geography(temporal_env, tmp_path) -> None:
    async for inc in open_incident_stack(temporal_env.client, tmp_path):
        a, c = inc.site("a"), inc.site("c")
        await inc.join("a", 3)
        await inc.join("c", 3)
        await inc.join("d", 1)
        inc.serve("llm", "a", replicas=1)
        inc.serve("llm", "c", replicas=1)
        inc.serve("llm", "d", replicas=0)
        out = tmp_path / "region.json"
        env = {**os.environ, **inc.settings.env()}
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "cli", "gameday", "region-loss", "--geo", "us-east", "--heal-after", "0.2",
             "--timeout", "120", "--json", str(out)],
            env=env, capture_output=True, text=True, timeout=180,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
        assert set(report["sites"]) == {a, c}, "both us-east sites were broken, nothing else"
        for site in (a, c):
            marks = report["sites"][site]["seconds_after_break"]
            assert report["sites"][site]["outcome"] == "restored"
            assert marks["weight 0"] <= marks["drained"]
            assert inc.world.site_row(site)["unreachable"] == 0
        assert inc.world.site_row(inc.site("d"))["unreachable"] == 0
        unknown = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "cli", "gameday", "region-loss", "--geo", "mars"],
            env=env, capture_output=True, text=True, timeout=60,
        )
        assert unknown.returncode == 2 and "mars" in unknown.stderr
