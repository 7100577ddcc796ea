"""The documentation site: it builds with strict link checking, the README stays a landing page
whose links resolve, and the generated reference pages are what the code says now."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from markdown.extensions.toc import slugify

from cli import reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).parent / "mkdocs"

README_MAX_LINES = 200


def outside_fences(text: str) -> list[str]:
    lines, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence:
            lines.append(line)
    return lines


def anchors(markdown_file: Path) -> set[str]:
    """The heading ids a page gets: an explicit ``{ #id }``, else the toc extension's slug."""
    found = set()
    for line in outside_fences(markdown_file.read_text()):
        heading = re.match(r"#{1,6} (.*)", line)
        if not heading:
            continue
        explicit = re.search(r"\{\s*#([\w-]+)\s*\}\s*$", heading.group(1))
        title = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.group(1))
        found.add(explicit.group(1) if explicit else slugify(title, "-"))
    return found


def relative_links(markdown_file: Path) -> list[str]:
    text = "\n".join(outside_fences(markdown_file.read_text()))
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # From the repository root: the snippets include (deploy/temporal/README.md) is relative to it.
    return subprocess.run([str(MKDOCS), "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.integration
def test_the_site_builds_with_strict_link_checking(tmp_path):
    built = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    site = tmp_path / "site"
    pages = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in ("getting-started/index.html", "concepts/index.html", "operations/index.html",
                 "production/index.html", "production/temporal/index.html", "production/node-image/index.html",
                 "providers/index.html",
                 "reference/cli/index.html", "reference/sites/index.html", "benchmarks/index.html",
                 "design/index.html"):
        assert page in pages, page
    assert (site / "reference" / "sites.schema.json").is_file()
    # deploy/temporal/README.md is included, not copied by hand: the page carries its text.
    temporal_page = (site / "production" / "temporal" / "index.html").read_text()
    assert "numHistoryShards" in temporal_page and "How this is tested" in temporal_page


@pytest.mark.integration
@pytest.mark.parametrize("broken", ["[a page](no-such-page.md)", "[an anchor](concepts/index.md#no-such-heading)"])
def test_a_broken_link_fails_the_build(tmp_path, broken):
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + f"\nSee {broken}.\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert broken.split("(")[1].rstrip(")") in built.stderr, built.stderr


def test_the_readme_is_a_landing_page_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    # The two set-up commands, exactly: CI runs the README's test command.
    assert "python3 bootstrap.py dev " in text and "python3 bootstrap.py test " in text
    links = relative_links(README)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), link
        if anchor:
            assert anchor in anchors(target), link


def test_the_readme_tour_is_the_tested_tour():
    """Every command of the README's short tour is one of the docs' tour, which
    tests/test_readme_walk.py runs as written, so the landing page cannot drift from it."""
    def commands(text: str) -> set[str]:
        found = set()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = " ".join(line.split())
                if line and not line.startswith("#"):
                    found.add(line)
        return found

    readme_tour = README.read_text().split("## The tour in short", 1)[1].split("\n## ", 1)[0]
    tour = commands(readme_tour)
    assert len(tour) >= 5
    assert tour <= commands((DOCS / "getting-started.md").read_text())


def test_every_alert_has_a_runbook():
    rules = yaml.safe_load((ROOT / "deploy" / "observability" / "alerts.yaml").read_text())
    alerts = [rule["alert"] for group in rules["groups"] for rule in group["rules"]]
    assert alerts
    runbooks = anchors(DOCS / "operations.md")
    for alert in alerts:
        assert slugify(alert, "-") in runbooks, alert


def test_every_workflow_is_in_the_concepts_map():
    from workflows.registry import ALL_WORKFLOWS

    table = (DOCS / "concepts" / "index.md").read_text().split("## Workflows and entities", 1)[1]
    for workflow in ALL_WORKFLOWS:
        definition = getattr(workflow, "__temporal_workflow_definition")
        assert f"`{definition.name}`" in table, definition.name
        for handler in [*definition.signals, *definition.updates, *definition.queries]:
            if handler and not handler.startswith("__"):
                row = next(line for line in table.splitlines() if f"`{definition.name}`" in line)
                assert f"`{handler}`" in row, (definition.name, handler)


def test_the_generated_references_are_current():
    for path, text in reference.generated().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run `python -m cli.reference`"


def test_the_cli_reference_lists_every_command():
    import typer.main

    from cli.main import app

    page = reference.CLI_PAGE.read_text()
    root = typer.main.get_command(app)
    ctx = root.make_context("gpufleet", [], resilient_parsing=True)
    for name in root.list_commands(ctx):
        assert f"## `gpufleet {name}`" in page, name


def test_the_schema_validates_the_shipped_configs_and_refuses_unknown_keys():
    schema = json.loads(reference.SITES_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    for config in (ROOT / "deploy" / "sites.example.yaml", ROOT / "fleet" / "default_sites.yaml"):
        jsonschema.validate(yaml.safe_load(config.read_text()), schema)
    shipped = yaml.safe_load((ROOT / "fleet" / "default_sites.yaml").read_text())
    shipped["sites"][0]["max_node"] = 3
    with pytest.raises(jsonschema.ValidationError, match="max_node"):
        jsonschema.validate(shipped, schema)


def test_every_line_of_the_threat_model_names_tests_that_exist():
    """docs/security.md says what a hostile node cannot do, one line each, and names the tests
    that try it: a renamed or deleted test leaves a line no test proves, and fails here."""
    text = (DOCS / "security.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| the ", "|---"))]
    assert len(rows) >= 25, "the threat model's tables"
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row)
        assert named, f"a line of the threat model that names no test: {row[:100]}"
        for path, name in named:
            source = ROOT / path
            assert source.is_file(), f"{path} (named by the threat model) does not exist"
            # Read as text, not parsed: CPython 3.11's ast.parse fails at random ("AST constructor
            # recursion depth mismatch", gh-106905) while another thread of the process compiles.
            tests = set(re.findall(r"^\s*(?:async\s+)?def\s+(\w+)", source.read_text(), re.MULTILINE))
            assert name in tests, f"{path}::{name} (named by the threat model) does not exist"


# -- what the operator pages name exists ------------------------------------------------------
ALERTS = ROOT / "deploy" / "observability" / "alerts.yaml"
OPERATOR_PAGES = [README, *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "deploy").rglob("README.md"))]


def runbook_summary(alert: str) -> str:
    """The italic line under an alert's runbook heading: "*Page; <expression> for <time>; labels ...*"."""
    section = (DOCS / "operations.md").read_text().split(f"\n### {alert}\n", 1)[1]
    return " ".join(section.strip().split("\n\n", 1)[0].split())


def spoken(duration: str) -> str:
    """Prometheus' ``for:`` as a runbook says it: 1m → "1 minute", 45m → "45 minutes"."""
    number, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()
    word = {"s": "second", "m": "minute", "h": "hour"}[unit]
    return f"{number} {word}" + ("" if number == "1" else "s")


def test_each_runbook_says_what_its_alert_is():
    """A runbook's first line says how the alert pages, for how long its condition held, and which
    series: "Ticket" where the rule pages, "for 10 minutes" where it waits 15, or a metric the
    rule does not read, send the operator to the wrong urgency or the wrong graph."""
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    wrong = []
    for rule in rules:
        line = runbook_summary(rule["alert"])
        severity = rule["labels"]["severity"]
        if not line.startswith(f"*{severity.capitalize()};"):
            wrong.append(f"{rule['alert']}: the rule's severity is {severity}: {line[:60]}")
        if rule["for"] not in ("0m", "0s") and f"for {spoken(rule['for'])}" not in line:
            wrong.append(f"{rule['alert']}: the rule waits {rule['for']} (\"for {spoken(rule['for'])}\"): {line}")
        for metric in re.findall(r"`((?:gpufleet|temporal)_\w+)", line):
            if metric not in rule["expr"]:
                wrong.append(f"{rule['alert']}: the rule does not read {metric}")
    assert not wrong, "\n".join(wrong)


def declared_metrics() -> set[str]:
    """Every metric family the control plane, the node agents and the gateway serve: the names their
    code declares (``"gpufleet_..."``), a counter's with its ``_total`` too."""
    found: set[str] = set()
    for folder in ("workers", "workflows", "activities", "fleet", "cli"):
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"\"(gpufleet_[a-z_]+)\"", path.read_text()))
    return found | {f"{name}_total" for name in found}


def test_every_metric_the_docs_name_is_served():
    """A query or a table row naming a series no one serves matches nothing, silently."""
    metrics = declared_metrics()
    assert {"gpufleet_nodes", "gpufleet_capacity_attempts_total", "gpufleet_gateway_refused"} <= metrics
    wrong = []
    for page in OPERATOR_PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            # A test's name (tests/x.py::test_..._gpufleet_...) is not a series.
            for name in re.findall(r"(?<![\w:/.])gpufleet_[a-z_]+", line):
                if name not in metrics:
                    wrong.append(f"{page.relative_to(ROOT)}:{number}: {name}")
    assert not wrong, "series no gpufleet process serves:\n" + "\n".join(wrong)


def test_every_variable_the_docs_name_is_read():
    """A ``GPUFLEET_*`` the docs tell an operator to set is one a process reads (fleet/settings.py
    declares each), or one the test suite reads (``GPUFLEET_RECORD``)."""
    from fleet.settings import declared

    tests = {name for path in (ROOT / "tests").rglob("*.py") for name in re.findall(
        r"environ(?:\.get)?[\[(]\s*\"(GPUFLEET_[A-Z0-9_]+)\"", path.read_text())}
    wrong = [f"{page.relative_to(ROOT)}: {name}" for page in OPERATOR_PAGES
             for name in sorted(set(re.findall(r"\bGPUFLEET_[A-Z0-9_]*[A-Z0-9]", page.read_text())))
             if name not in declared() and name not in tests]
    assert not wrong, "variables nothing reads:\n" + "\n".join(wrong)


def test_the_operations_metrics_table_lists_every_family_the_control_plane_serves():
    """docs/operations.md's table is where an operator looks up a series an alert or a graph
    shows: each family workers/metrics.py serves, and each one an alert reads, has its row."""
    table = (DOCS / "operations.md").read_text().split("| metric | labels | from |", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"`(gpufleet_\w+)`", table))
    served = set(re.findall(r"(?:GaugeMetricFamily|Gauge)\(\s*\"(gpufleet_\w+)\"", (ROOT / "workers" / "metrics.py").read_text()))
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    alerted = {name for rule in rules for name in re.findall(r"\b(gpufleet_\w+?)(?:_bucket)?\{", rule["expr"])}
    assert len(served) > 15 and alerted
    assert not (served | alerted) - listed, sorted((served | alerted) - listed)
