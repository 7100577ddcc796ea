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
