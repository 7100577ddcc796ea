"""Metrics as an operator sees them: a real Prometheus scrapes a control-plane worker
and its simulated nodes after a join, a capacity request, GPU faults, an orphaned
machine, routing and a weights replication; PromQL answers for every fleet metric and
the SDK's own. The dashboard and the alert rules use only metrics the scrape has."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from activities.env import FleetEnv
from fleet.cluster import LABEL_SITE, ServingSpec, SiteRoute
from fleet.models import MachineSpec
from fleet.settings import Settings
from fleet.temporal import connect
from tests.capacity_fleet import FAST_JOIN, capacity_fleet
from tests.conftest import terminate_running
from tests.repair_helpers import REPAIR
from tests.rollout.conftest import moto_s3, put_files  # noqa: F401 - moto_s3 is a fixture
from tests.ports import free_port
from tests.tools import find, needs, require
from workers.control_plane import build_worker
from tests.test_cli_columns import snapshot
from workers.metrics import MetricsServer, agents_running, fleet_families, watch_fleet
from workers.node_agent import SimNodeHost

ROOT = Path(__file__).resolve().parents[1]
OBSERVABILITY = ROOT / "deploy" / "observability"
PROMETHEUS = find("prometheus")
PROMTOOL = find("promtool")
#: Skipped without it, naming how to get it; failed in CI, which installs it (tests/tools.py).
needs_prometheus = needs("prometheus")


class Prometheus:
    def __init__(self, tmp: Path, scrape_configs: list[dict]) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(OBSERVABILITY / "alerts.yaml")],
            "scrape_configs": scrape_configs,
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> dict[tuple, float]:
        """{sorted label items (without __name__): value}."""
        try:
            data = self.api("query", query=promql)
        except OSError:
            return {}
        return {tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")): float(r["value"][1])
                for r in data["result"]}

    async def value(self, promql: str, expected: float, timeout: float = 30) -> float:
        """Wait until the (single) value of ``promql`` is ``expected``."""
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            seen = self.query(promql)
            if len(seen) == 1 and abs(next(iter(seen.values())) - expected) < 1e-6:
                return expected
            await asyncio.sleep(0.5)
        raise AssertionError(f"{promql}: expected {expected}, Prometheus says {seen}")

    def names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.log.close()


def referenced_metrics(text: str) -> set[str]:
    return set(re.findall(r"\b((?:gpufleet|temporal)_[a-z0-9_]+)", text))


def dashboard() -> dict:
    return json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())


def dashboard_exprs() -> list[str]:
    """Every PromQL expression the dashboard runs: its panels' and its annotations'."""
    board = dashboard()
    return ([t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
            + [a["expr"] for a in board["annotations"]["list"] if "expr" in a])


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())["groups"] for r in g["rules"]]


def test_a_source_that_did_not_answer_has_no_series_not_zeros() -> None:
    """Before: a cluster that did not answer was scraped as 0 ready nodes at every site, which
    pages GpufleetSiteBelowMinimum for each of them after 30 minutes (and $0/h of spend, 0
    orphans); only gpufleet_source_up told. Now its families are absent, as the snapshot says."""
    snap = snapshot()
    families = {f.name: f for f in fleet_families(snap)}
    assert {"gpufleet_nodes", "gpufleet_gpus", "gpufleet_spend_dollars_per_hour", "gpufleet_orphaned_machines"} <= set(families)
    snap.errors["cluster"] = "ConnectionRefusedError: the API server is away"
    families = {f.name: f for f in fleet_families(snap)}
    assert not {"gpufleet_nodes", "gpufleet_gpus", "gpufleet_spend_dollars_per_hour",
                "gpufleet_orphaned_machines"} & set(families)
    # What needs no cluster stays: the configured bounds, what Temporal's visibility says.
    assert {"gpufleet_site_min_nodes", "gpufleet_incidents_open", "gpufleet_site_routing_weight"} <= set(families)
    up = {s.labels["source"]: s.value for s in families["gpufleet_source_up"].samples}
    assert up == {"cluster": 0, "temporal": 1, "accounts": 1, "routing": 1}
    # Spend counted from the providers' machines (the simulated fleet) does not need the cluster.
    snap.spend_from = "providers"
    assert "gpufleet_spend_dollars_per_hour" in {f.name for f in fleet_families(snap)}


def test_alert_rules_pass_promtool() -> None:
    require("promtool")
    checked = subprocess.run([PROMTOOL, "check", "rules", str(OBSERVABILITY / "alerts.yaml")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    alerts = {r["alert"] for r in alert_rules()}
    assert {"GpufleetAccountNeedsPerson", "GpufleetIncidentOpen", "GpufleetRepairStuckOnRung", "GpufleetNodeNeedsPerson",
            "GpufleetOrphanedMachine", "GpufleetScheduleToStartHigh", "GpufleetSiteBelowMinimum"} <= alerts


PROMETHEUS_RULE = ROOT / "deploy" / "prometheus-operator" / "prometheus-rule.yaml"


def test_the_prometheus_rule_holds_the_alert_rules_groups() -> None:
    """Prometheus Operator users get the same alerts as `rule_files:` users: the PrometheusRule's
    groups are alerts.yaml's, rule for rule, and every place that names it names a file that exists."""
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["metadata"]["namespace"] == "gpufleet"
    assert rule["spec"]["groups"] == yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())["groups"]
    named = {}
    for path in [OBSERVABILITY / "alerts.yaml", *(ROOT / "docs").rglob("*.md"), ROOT / "README.md",
                 *(ROOT / "deploy").rglob("*.yaml")]:
        for found in re.findall(r"deploy/[\w/.-]*prometheus-rule\.yaml", path.read_text()):
            named.setdefault(found, []).append(str(path.relative_to(ROOT)))
    assert named and all((ROOT / found).exists() for found in named), named
    assert "docs/operations.md" in named.get("deploy/prometheus-operator/prometheus-rule.yaml", [])


@needs("promtool")
def test_the_prometheus_rules_groups_and_the_dashboards_queries_pass_promtool(tmp_path: Path) -> None:
    """promtool accepts the PrometheusRule's groups as a rule file, and every dashboard query (each
    checked as a recording rule: its PromQL parses, with the variables as Grafana fills them in)."""
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    (tmp_path / "operator.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    queries = [{"record": f"gpufleet_dashboard:query_{i}", "expr": expr.replace("$site", ".*")}
               for i, expr in enumerate(dashboard_exprs())]
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": queries}]}))
    for name in ("operator.yaml", "dashboard.yaml"):
        checked = subprocess.run([require("promtool"), "check", "rules", str(tmp_path / name)],
                                 capture_output=True, text=True)
        assert checked.returncode == 0, name + ": " + checked.stdout + checked.stderr
        assert "SUCCESS" in checked.stdout, checked.stdout


# -- what a node's agent serves decides nothing about the rest of the fleet -----------------------
# A GPU node is hostile (docs/security.md): its agent, or anything on it answering the scrape, may
# serve any series it likes, named like the control plane's. Its ServiceMonitor keeps only the
# names the agent defines, within limits; the alert rules read the control plane's job only.

SERVICE_MONITORS = ROOT / "deploy" / "prometheus-operator" / "servicemonitor.yaml"
METRICS_SERVICES = ROOT / "deploy" / "kubernetes" / "monitoring.yaml"
#: The job the alert rules read: the control plane's metrics Service, as its ServiceMonitor names it.
CONTROL_PLANE_JOB = "gpufleet-control-plane"
NODE_AGENT_JOB = "gpufleet-node-agent"
#: A ServiceMonitor's limits and the scrape settings Prometheus's configuration calls them.
SCRAPE_LIMITS = {"sampleLimit": "sample_limit", "labelLimit": "label_limit",
                 "labelNameLengthLimit": "label_name_length_limit",
                 "labelValueLengthLimit": "label_value_length_limit", "bodySizeLimit": "body_size_limit"}
RELABEL_FIELDS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex",
                  "replacement": "replacement", "separator": "separator", "modulus": "modulus", "action": "action"}


def service_monitors() -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in yaml.safe_load_all(SERVICE_MONITORS.read_text())}


def monitor_job(monitor: dict, service: str) -> str:
    """The `job` the Prometheus Operator gives the series of a metrics Service the monitor scrapes:
    the value of the Service's label its jobLabel names, else the Service's name."""
    (found,) = [s for s in yaml.safe_load_all(METRICS_SERVICES.read_text()) if s["metadata"]["name"] == service]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= found["metadata"]["labels"].items(), service
    return found["metadata"]["labels"].get(monitor["spec"].get("jobLabel", ""), service)


def scrape_config(monitor: dict, job: str, targets: list[dict]) -> dict:
    """A ServiceMonitor's scrape settings as the Prometheus Operator writes them into Prometheus's
    configuration (its job, limits, honor_labels, target and metric relabelings), for static
    targets that stand for what the operator's Kubernetes discovery finds: their labels are its
    target labels and __meta_kubernetes_* labels, which Prometheus drops after relabeling."""
    (endpoint,) = monitor["spec"]["endpoints"]

    def relabel(rules: list[dict]) -> list[dict]:
        return [{RELABEL_FIELDS[k]: (v.lower() if k == "action" else v) for k, v in rule.items()} for rule in rules]

    config = {"job_name": job, "static_configs": targets, "honor_labels": endpoint.get("honorLabels", False),
              "relabel_configs": relabel(endpoint.get("relabelings", [])),
              "metric_relabel_configs": relabel(endpoint.get("metricRelabelings", []))}
    config.update({ours: monitor["spec"][theirs] for theirs, ours in SCRAPE_LIMITS.items()
                   if theirs in monitor["spec"]})
    return config


def kept_names(monitor: dict) -> set[str]:
    """The metric names a monitor's one `keep` on __name__ lets through: an alternation of names."""
    (endpoint,) = monitor["spec"]["endpoints"]
    (keep,) = endpoint["metricRelabelings"]
    assert (keep["action"], keep["sourceLabels"]) == ("keep", ["__name__"]), keep
    names = set(keep["regex"].split("|"))
    assert all(re.fullmatch(r"[a-z_]+", n) for n in names), "each alternative is a literal name"
    return names


#: What the node agent's process holds in its Python registry (workers.node_agent.main: the client
#: library's default collectors, and gpufleet_node_agents_running), printed by a fresh interpreter.
NODE_AGENT_REGISTRY = """
import workers.node_agent
from prometheus_client import REGISTRY
from workers.metrics import agents_running
agents_running(lambda: 1)
for family in REGISTRY.collect():
    print(family.type, family.name, *sorted({sample.name for sample in family.samples}))
"""
#: The samples of a family, by its type, as the text format names them.
SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
                   "info": ("_info",)}


def node_agent_registry_names() -> set[str]:
    printed = subprocess.run([sys.executable, "-c", NODE_AGENT_REGISTRY], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    names = set()
    for line in printed.splitlines():
        kind, family, *samples = line.split()
        names |= {family + suffix for suffix in SAMPLE_SUFFIXES[kind]} | set(samples)
    return names


def sdk_activity_worker_names() -> set[str]:
    """The Temporal SDK's metrics of an activity worker and its client (the node agent's worker runs
    activities only: workers.node_agent.build_agent), named as the SDK's Prometheus exporter names
    them for workers.metrics.MetricsServer (prefix temporal_, durations in seconds, counters _total).
    Read from the SDK's own metric definitions, the sdk-core source its package ships."""
    import temporalio

    crates = Path(temporalio.__file__).parent / "bridge" / "sdk-core" / "crates"
    worker = (crates / "sdk-core" / "src" / "telemetry" / "metrics.rs").read_text()
    client = (crates / "client" / "src" / "metrics.rs").read_text()
    common = (crates / "common" / "src" / "telemetry" / "metrics.rs").read_text()
    constants = dict(re.findall(r'(?:const|static) (\w+): &str =\s*"(\w+)"', common + worker + client))
    names = set()
    # The worker's activity metrics, its slots and pollers; not its workflows', local activities',
    # Nexus tasks' or sticky cache's. Every metric of the client.
    for source, prefixes in ((worker, ("activity_", "worker_", "num_pollers")), (client, ("",))):
        for maker, name, params in re.findall(r'(\w+)\(MetricParameters \{\s*name: (\w+|"\w+")\.into\(\),(.*?)\}\)',
                                              source, re.S):
            name = name.strip('"') if name.startswith('"') else constants[name]
            if not name.startswith(prefixes):
                continue
            unit = re.search(r'unit: "(\w*)"', params).group(1)
            assert unit in ("", "duration"), (name, unit)
            name = "temporal_" + name + ("_seconds" if unit == "duration" else "")
            kind = next(k for k in ("counter", "histogram", "gauge") if k in maker)
            names |= {name + suffix for suffix in SAMPLE_SUFFIXES[kind]}
    assert "temporal_activity_schedule_to_start_latency_seconds_bucket" in names, "the SDK's source was read"
    return names


@pytest.mark.integration  # the node agent's registry, printed by a Python process of its own
def test_the_node_agents_scrape_keeps_only_the_names_the_agent_defines_within_limits() -> None:
    """The node agents have a ServiceMonitor of their own. It keeps exactly the names the agent
    defines (its Python registry, as its process builds it, and the SDK's metrics of an activity
    worker and its client, from the SDK's source), so a new metric of the agent's fails here until
    the monitor keeps it; it sets every per-scrape limit. No monitor honours the labels a page
    names (job, instance, node)."""
    monitors = service_monitors()
    node = monitors["gpufleet-node-agent"]
    assert monitor_job(node, "gpufleet-node-agent-metrics") == NODE_AGENT_JOB
    assert kept_names(node) == node_agent_registry_names() | sdk_activity_worker_names()
    assert all(isinstance(node["spec"][k], int) and node["spec"][k] > 0 for k in SCRAPE_LIMITS if k != "bodySizeLimit")
    assert re.fullmatch(r"[0-9]+(Ki|Mi)B", node["spec"]["bodySizeLimit"]), node["spec"]["bodySizeLimit"]
    # The control plane's monitor does not scrape the node agents (theirs is the only one that does).
    others = [m for name, m in monitors.items() if name != "gpufleet-node-agent"]
    for monitor in others:
        chosen = {v for term in monitor["spec"]["selector"].get("matchExpressions", [])
                  if term["key"] == "app.kubernetes.io/name" and term["operator"] == "In" for v in term["values"]}
        assert chosen and "gpufleet-node-agent" not in chosen, monitor["metadata"]["name"]
    for monitor in monitors.values():
        assert not any(e.get("honorLabels") for e in monitor["spec"]["endpoints"]), monitor["metadata"]["name"]


def test_every_alert_reads_the_control_planes_job_only() -> None:
    """Every metric an alert rule reads is selected by the control plane's job, the job its
    ServiceMonitor gives the control plane's metrics Service: a node's series of the same name feed
    no alert. So do the dashboard's queries of a name a node agent's scrape keeps (its SDK's
    schedule-to-start), but for the agents' own count."""
    assert monitor_job(service_monitors()["gpufleet"], "gpufleet-control-plane-metrics") == CONTROL_PLANE_JOB
    selected = f'job="{CONTROL_PLANE_JOB}"'
    for rule in alert_rules():
        for found in re.finditer(r"\b(?:gpufleet|temporal)_[a-z0-9_]+(\{[^}]*\})?", rule["expr"]):
            assert selected in (found.group(1) or ""), (rule["alert"], found.group(0))
    node_names = kept_names(service_monitors()["gpufleet-node-agent"]) - {"gpufleet_node_agents_running"}
    for expr in dashboard_exprs():
        for found in re.finditer(r"\b((?:gpufleet|temporal)_[a-z0-9_]+)(\{[^}]*\})?", expr):
            if found.group(1) in node_names:
                assert selected in (found.group(2) or ""), (expr, found.group(0))


def test_a_site_the_config_no_longer_names_is_a_series_while_it_has_nodes_or_an_entity() -> None:
    """Before: a site removed from the config with nodes left vanished from every figure (no
    gpufleet_spend_dollars_per_hour, no min/max), its machines billed with nothing to alert on.
    Now each such site is a series: its nodes, or 0 with only its Site entity left running."""
    snap = snapshot()
    snap.nodes["removed"]["ready"] = 2
    snap.nodes["removed"]["cordoned"] = 1
    snap.site_states["emptied"] = "ok"
    snap.nodes[""]["ready"] = 3  # the cluster's own nodes: no site at all
    families = {f.name: f for f in fleet_families(snap)}
    series = {s.labels["site"]: s.value for s in families["gpufleet_site_not_configured"].samples}
    assert series == {"removed": 3, "emptied": 0}
    snap.errors["temporal"] = "RPCError: the frontend is away"
    families = {f.name: f for f in fleet_families(snap)}
    assert {s.labels["site"]: s.value for s in families["gpufleet_site_not_configured"].samples} == {"removed": 3}
    snap.errors["cluster"] = "ConnectionRefusedError: the API server is away"
    assert "gpufleet_site_not_configured" not in {f.name for f in fleet_families(snap)}, "no nodes known: no series"


@needs("promtool")
def test_a_site_not_configured_raises_its_alert_after_15_minutes(tmp_path: Path) -> None:
    """`promtool test rules`: a removed site with nodes, and one with only its entity left, each
    raise GpufleetSiteNotConfigured once their series has stood for 15 minutes, not before."""
    cp = f'job="{CONTROL_PLANE_JOB}",instance="10.0.0.2:9464"'
    series = [{"series": f'gpufleet_site_not_configured{{{cp},site="removed"}}', "values": "2x30"},
              {"series": f'gpufleet_site_not_configured{{{cp},site="emptied"}}', "values": "0x30"}]
    fired = [{"exp_labels": {"severity": "ticket", "site": site, "job": CONTROL_PLANE_JOB,
                             "instance": "10.0.0.2:9464"}} for site in ("emptied", "removed")]
    run_shipped_alert_rules(tmp_path, series, [
        {"eval_time": "10m", "alertname": "GpufleetSiteNotConfigured", "exp_alerts": []},
        {"eval_time": "20m", "alertname": "GpufleetSiteNotConfigured", "exp_alerts": fired}])


@needs("promtool")
def test_a_nodes_series_under_the_control_planes_names_neither_silence_nor_raise_an_alert(tmp_path: Path) -> None:
    """`promtool test rules` over the shipped rules. A node's agent serves series named like the
    control plane's, under its own job: 5 ready nodes at site a (below its minimum of 2 with the
    control plane's 1), a hundred times as many workflow tasks on the control plane's queue started
    within a second (which would bring the p95 of 4.8 s under the alert's 2 s), an open incident at
    a and an account needing a person, three unwatched nodes at b. The control plane's own figures
    still raise GpufleetSiteBelowMinimum, GpufleetScheduleToStartHigh and GpufleetNodeUnwatched (a
    node at a unwatched for 35 minutes; not b's, started again within 10); the node's raise nothing."""
    cp = f'job="{CONTROL_PLANE_JOB}",instance="10.0.0.2:9464"'
    node = f'job="{NODE_AGENT_JOB}",instance="10.0.0.9:9465",node="gpu-9"'

    def waits(labels: str, le: str, values: str) -> dict:
        return {"series": f'temporal_workflow_task_schedule_to_start_latency_seconds_bucket'
                          f'{{{labels},task_queue="gpufleet",le="{le}"}}', "values": values}

    series = [
        {"series": f'gpufleet_nodes{{{cp},site="a",provider="lambda",state="ready"}}', "values": "1x40"},
        {"series": f'gpufleet_site_min_nodes{{{cp},site="a",provider="lambda"}}', "values": "2x40"},
        {"series": f'gpufleet_nodes{{{node},site="a",provider="lambda",state="ready"}}', "values": "5x40"},
        # 60 a minute, each between 1 and 5 s; the node's 6,000 a minute under 1 s.
        waits(cp, "1", "0x40"), waits(cp, "5", "0+60x40"), waits(cp, "+Inf", "0+60x40"),
        waits(node, "1", "0+6000x40"), waits(node, "5", "0+6000x40"), waits(node, "+Inf", "0+6000x40"),
        {"series": f'gpufleet_incidents_open{{{cp},site="a"}}', "values": "0x40"},
        {"series": f'gpufleet_incidents_open{{{cp},site="b"}}', "values": "1x40"},
        {"series": f'gpufleet_incidents_open{{{node},site="a"}}', "values": "1x40"},
        {"series": f'gpufleet_account_needs_person{{{node},provider="lambda",account="main",'
                   f'state="credentials-revoked"}}', "values": "1x40"},
        # A node left unwatched at a since the start; one at b for 10 minutes (the sweep's pass
        # started its entity again); the node's own series says b has three.
        {"series": f'gpufleet_nodes_unwatched{{{cp},site="a"}}', "values": "1x40"},
        {"series": f'gpufleet_nodes_unwatched{{{cp},site="b"}}', "values": "0x20 1x10 0x10"},
        {"series": f'gpufleet_nodes_unwatched{{{node},site="b"}}', "values": "3x40"},
    ]
    expected = {
        "GpufleetSiteBelowMinimum": [{"exp_labels": {"severity": "ticket", "site": "a"}}],
        "GpufleetScheduleToStartHigh": [{"exp_labels": {"severity": "ticket", "task_queue": "gpufleet"}}],
        "GpufleetIncidentOpen": [{"exp_labels": {"severity": "page", "site": "b", "job": CONTROL_PLANE_JOB,
                                                 "instance": "10.0.0.2:9464"}}],
        "GpufleetAccountNeedsPerson": [],
        "GpufleetNodeUnwatched": [{"exp_labels": {"severity": "ticket", "site": "a", "job": CONTROL_PLANE_JOB,
                                                  "instance": "10.0.0.2:9464"}}],
    }
    run_shipped_alert_rules(tmp_path, series, [{"eval_time": "35m", "alertname": name, "exp_alerts": alerts}
                                           for name, alerts in expected.items()])


def run_shipped_alert_rules(tmp_path: Path, series: list[dict], alert_rule_test: list[dict]) -> None:
    """`promtool test rules` of the shipped rules over ``series`` (one a minute), without their
    annotations: promtool compares an alert's annotations whole, and what is under test is which
    series raise it."""
    groups = yaml.safe_load((OBSERVABILITY / "alerts.yaml").read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": [str(tmp_path / "rules.yaml")],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": alert_rule_test}],
    }))
    tested = subprocess.run([require("promtool"), "test", "rules", str(tmp_path / "test.yaml")],
                            capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


class Pages:
    """An HTTP server answering each path with its page, as a node's metrics port would."""

    def __init__(self, pages: dict[str, bytes]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = pages.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def byte_size(text: str) -> int:
    number, unit = re.fullmatch(r"([0-9]+)(Ki|Mi)?B", text).groups()
    return int(number) * {None: 1, "Ki": 1024, "Mi": 1024 * 1024}[unit]


@needs_prometheus
@pytest.mark.timeout(120)
async def test_a_hostile_node_agent_page_stores_none_of_its_forgeries_and_one_past_a_limit_stores_nothing(
        tmp_path: Path) -> None:
    """A real Prometheus scrapes pages a hostile node serves, with the node agents' ServiceMonitor's
    settings (the pod's node name as the operator's discovery gives it). A page forging the control
    plane's names and labels: only the agent's own names are stored, and under the target's job,
    instance and node, the pod's (the page's own are kept as exported_*). A page past
    any limit (samples, labels, a label's name or value, its size, the bulk of it dropped names)
    fails its scrape whole: up is 0 and nothing of it is stored."""
    node = service_monitors()["gpufleet-node-agent"]
    limits = node["spec"]
    honest = ('gpufleet_node_agents_running 1\n'
              'temporal_num_pollers{poller_type="activity_task",task_queue="node/gpu-1"} 1\n')
    forged = ('gpufleet_nodes{site="a",provider="lambda",state="ready"} 100\n'
              'gpufleet_site_min_nodes{site="a",provider="lambda"} 0\n'
              'temporal_workflow_task_schedule_to_start_latency_seconds_bucket{task_queue="gpufleet",le="+Inf"} 1e6\n'
              f'temporal_worker_start_total{{job="{CONTROL_PLANE_JOB}",instance="10.0.0.2:9464",node="gpu-2"}} 1\n')
    dropped_names = "".join(f'gpufleet_nodes{{site="s{i}",state="ready"}} 1\n'
                            for i in range(byte_size(limits["bodySizeLimit"]) // 30))
    pages = {
        "forging": honest + forged,
        "samples": honest + "".join(f'temporal_request_total{{operation="op{i}"}} 1\n'
                                    for i in range(limits["sampleLimit"])),
        "labels": honest + "temporal_request_total{" + ",".join(f'l{i}="x"' for i in range(limits["labelLimit"]))
        + "} 1\n",
        "label-name": honest + f'temporal_request_total{{{"l" * (limits["labelNameLengthLimit"] + 1)}="x"}} 1\n',
        "label-value": honest
        + f'temporal_request_total{{operation="{"x" * (limits["labelValueLengthLimit"] + 1)}"}} 1\n',
        "body": honest + dropped_names,
    }
    assert len(pages["body"]) > byte_size(limits["bodySizeLimit"])
    server = Pages({f"/{name}": page.encode() for name, page in pages.items()})
    targets = [{"targets": [server.address], "labels": {"__meta_kubernetes_pod_node_name": "gpu-1", "page": name,
                                                        "__metrics_path__": f"/{name}"}}
               for name in pages]
    prom = Prometheus(tmp_path, [scrape_config(node, NODE_AGENT_JOB, targets)])
    try:
        deadline = time.monotonic() + 60
        while len(up := prom.query(f'up{{job="{NODE_AGENT_JOB}"}}')) < len(pages):
            assert time.monotonic() < deadline, up
            await asyncio.sleep(0.5)
        assert {dict(labels)["page"]: value for labels, value in up.items()} == {
            "forging": 1, "samples": 0, "labels": 0, "label-name": 0, "label-value": 0, "body": 0}
        stored = prom.query(f'{{job="{NODE_AGENT_JOB}",__name__!~"up|scrape_.*"}}')
        assert {dict(labels)["page"] for labels in stored} == {"forging"}, "a failed scrape stores nothing"
        stored_names = set(prom.api("label/__name__/values", **{"match[]": '{page="forging"}'}))
        assert {n for n in stored_names if n != "up" and not n.startswith("scrape_")} == {
            "gpufleet_node_agents_running", "temporal_num_pollers", "temporal_worker_start_total"}
        (spoofing,) = [dict(labels) for labels in prom.query("temporal_worker_start_total")]
        assert spoofing == {"job": NODE_AGENT_JOB, "instance": server.address, "node": "gpu-1", "page": "forging",
                            "exported_job": CONTROL_PLANE_JOB, "exported_instance": "10.0.0.2:9464",
                            "exported_node": "gpu-2"}
    finally:
        prom.stop()
        server.close()


@needs_prometheus
@pytest.mark.timeout(120)
async def test_a_pod_a_node_made_is_never_scraped_as_the_control_plane(tmp_path: Path) -> None:
    """A node may create pods bound to itself (the mirrors of its static pods) with any labels, so
    one labelled as the control plane is an endpoint of its metrics Service. A real Prometheus, with
    the control plane's ServiceMonitor's settings, over three endpoints as the operator's discovery
    gives them: the control plane's pod, a pod with the mirror annotation and a pod owned by a Node,
    each serving a different count of ready nodes at site a. Only the control plane's is scraped."""
    monitor = service_monitors()["gpufleet"]
    marks = {"control-plane": {},
             "mirror": {"__meta_kubernetes_pod_annotationpresent_kubernetes_io_config_mirror": "true"},
             "node-owned": {"__meta_kubernetes_pod_controller_kind": "Node"}}
    server = Pages({f"/{name}": f'gpufleet_nodes{{site="a",state="ready"}} {i}\n'.encode()
                    for i, name in enumerate(marks)})
    targets = [{"targets": [server.address], "labels": {**labels, "pod": name, "__metrics_path__": f"/{name}"}}
               for name, labels in marks.items()]
    prom = Prometheus(tmp_path, [scrape_config(monitor, CONTROL_PLANE_JOB, targets)])
    try:
        await prom.value(f'gpufleet_nodes{{job="{CONTROL_PLANE_JOB}",site="a"}}', 0)
        assert [dict(labels)["pod"] for labels in prom.query("up")] == ["control-plane"]
        active = prom.api("targets")["activeTargets"]
        assert [t["labels"]["pod"] for t in active] == ["control-plane"], active
    finally:
        prom.stop()
        server.close()


#: What a panel shows a problem by: counts that should be zero, and the rates of trouble (a
#: latency percentile, a share of failures). Such a panel colours itself past a threshold.
PROBLEM_COUNTS = ("gpufleet_incidents_open", "gpufleet_account_needs_person", "gpufleet_orphaned_machines",
                  "gpufleet_repair_in_progress", "gpufleet_account_blocked_offers", 'state="not-ready"')
PROBLEM_RATES = ("histogram_quantile(", 'result!="ok"')


def test_dashboard_tables_are_instant_and_problem_panels_have_thresholds() -> None:
    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    tables = [p for p in panels if p["type"] == "table"]
    assert len(tables) >= 5
    for table in tables:
        # A table shows the state now: one instant query, as a table (not a range of samples per series).
        for target in table["targets"]:
            assert (target.get("instant"), target.get("range"), target.get("format")) == (True, False, "table"), \
                (table["title"], target)
    problems = [p for p in panels if any(m in t["expr"] for t in p["targets"] for m in PROBLEM_COUNTS + PROBLEM_RATES)]
    assert {"Open incidents", "Accounts needing a person", "Orphaned machines", "Site state", "Open repairs",
            "Blocked offers per account", "Workflow task schedule-to-start p95",
            "Activity schedule-to-start p95 (control plane)", "Capacity attempts failing (15m)"} <= \
        {p["title"] for p in problems}
    for panel in problems:
        defaults = panel["fieldConfig"]["defaults"]
        steps = defaults.get("thresholds", {}).get("steps", [])
        assert len(steps) >= 2 and steps[0] == {"color": "green", "value": None}, panel["title"]
        assert all(step["color"] != "green" for step in steps[1:]), panel["title"]
        if panel["type"] == "timeseries":  # drawn on the graph, not only in the legend
            assert defaults["custom"]["thresholdsStyle"]["mode"] != "off", panel["title"]
        else:
            assert defaults["color"] == {"mode": "thresholds"}, panel["title"]
    # The latency panels turn where GpufleetScheduleToStartHigh fires.
    by_title = {p["title"]: p for p in panels}
    rules = {r["alert"]: r["expr"] for r in alert_rules()}
    for title, limit in (("Workflow task schedule-to-start p95", 2), ("Activity schedule-to-start p95 (control plane)", 10)):
        assert by_title[title]["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == limit
        assert re.search(rf"\)\s*>\s*{limit}\b", rules["GpufleetScheduleToStartHigh"]), limit


def defined_metrics() -> set[str]:
    """The gpufleet metrics the code defines (a Counter is scraped with ``_total``)."""
    names = set()
    for path in (ROOT / "workers" / "metrics.py", ROOT / "activities" / "metrics.py"):
        text = path.read_text()
        names |= set(re.findall(r'(?:GaugeMetricFamily|Gauge)\(\s*"(gpufleet_[a-z_]+)"', text))
        names |= {f"{n}_total" for n in re.findall(r'Counter\(\s*"(gpufleet_[a-z_]+)"', text)}
    return names


def test_dashboard_marks_incidents_and_rollouts_and_links_to_the_temporal_ui() -> None:
    board = dashboard()
    annotations = {a["name"]: a for a in board["annotations"]["list"]}
    assert {"Provider incidents", "Rollouts"} <= set(annotations)
    assert "gpufleet_incidents_open" in annotations["Provider incidents"]["expr"]
    assert "gpufleet_weights_verified_bytes_total" in annotations["Rollouts"]["expr"]
    known = defined_metrics()
    assert {"gpufleet_incidents_open", "gpufleet_weights_verified_bytes_total", "gpufleet_nodes"} <= known, known
    for annotation in annotations.values():
        assert annotation["enable"] and annotation["datasource"]["type"] == "prometheus", annotation
        used = {m for m in referenced_metrics(annotation["expr"]) if m.startswith("gpufleet_")}
        assert used and used <= known, (annotation["name"], used - known)
    # The Temporal UI is a variable: the dashboard's links and each table row's link open workflows there.
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["temporal_ui"]["type"] == "textbox" and variables["temporal_ui"]["query"].startswith("http")
    assert "temporal_namespace" in variables
    ui = "${temporal_ui}/namespaces/${temporal_namespace}/workflows"
    links = {link["title"]: link for link in board["links"]}
    assert links["Temporal UI"]["url"] == ui and all(link["url"].startswith(ui) for link in links.values())
    assert "SiteEvacuation" in urllib.parse.unquote(links["Running evacuations"]["url"])
    open_repairs = next(p for p in board["panels"] if p["title"] == "Open repairs")
    (row_link,) = open_repairs["fieldConfig"]["defaults"]["links"]
    assert row_link["url"] == ui + "/${__data.fields.repair:percentencode}"


def test_dashboard_has_the_four_views() -> None:
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    rows = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert rows == {"Fleet overview", "Site", "Repairs", "Capacity and spend"}
    assert any(v["name"] == "site" for v in dashboard["templating"]["list"])
    assert all(dashboard_exprs())


@needs_prometheus
@pytest.mark.timeout(180)
async def test_prometheus_sees_the_fleet(temporal_env, tmp_path: Path, moto_s3, monkeypatch) -> None:  # noqa: F811
    uid = uuid.uuid4().hex[:6]
    fleet = capacity_fleet(uid)
    fleet["repair"] = REPAIR
    fleet["incident"] = {"settle_seconds": 0}
    (tmp_path / "sites.yaml").write_text(yaml.safe_dump(fleet))
    settings = Settings(address=temporal_env.client.service_client.config.target_host, task_queue=f"obs-{uid}",
                        state_dir=tmp_path, config=str(tmp_path / "sites.yaml"))
    cheap, mid, dear = (f"{n}-{uid}" for n in ("cheap", "mid", "dear"))
    monkeypatch.setenv("GPUFLEET_ORPHAN_GRACE_SECONDS", "0")

    server = MetricsServer(0, "control-plane", host="127.0.0.1")
    client = await connect(settings, runtime=server.runtime)
    env = FleetEnv.from_settings(settings)
    collector = watch_fleet(env, client, settings.task_queue)
    # The node agents' page apart, as their own process serves it (workers.node_agent.main): their
    # SDK metrics through a runtime of their own, and their count; scraped as their ServiceMonitor says.
    agents_server = MetricsServer(0, "node-agent", host="127.0.0.1", registry=CollectorRegistry(),
                                  worker_heartbeats=False)
    host = SimNodeHost(await connect(settings, runtime=agents_server.runtime), settings, poll_seconds=0.05)
    host.health_seconds = 0.2
    agents_running(lambda: len(host.agents), registry=agents_server.registry)
    stop = asyncio.Event()
    host_task = asyncio.create_task(host.run(stop))
    monitors = service_monitors()
    prom = Prometheus(tmp_path, [
        scrape_config(monitors["gpufleet"], CONTROL_PLANE_JOB, [{"targets": [f"127.0.0.1:{server.port}"]}]),
        scrape_config(monitors["gpufleet-node-agent"], NODE_AGENT_JOB,
                      [{"targets": [f"127.0.0.1:{agents_server.port}"],
                        "labels": {"__meta_kubernetes_pod_node_name": "sim-host"}}]),
    ])
    try:
        async with build_worker(client, settings, env):
            # A join of two nodes at the cheapest site.
            join = await client.start_workflow("NodeJoin", {"site": cheap, "count": 2, "timeouts": FAST_JOIN},
                                               id=f"join/{cheap}/obs", task_queue=settings.task_queue)
            joined = (await join.result())["nodes"]
            # A capacity request meeting a full quota there: OverQuota (a person must act), then the next site.
            env.world.set_site(cheap, quota=2)
            request = await client.start_workflow(
                "AcquireCapacity", {"constraints": {"gpu": "H100"}, "count": 1, "join_timeouts": FAST_JOIN},
                id=f"capacity/obs-{uid}", task_queue=settings.task_queue)
            got = (await request.result())["nodes"]
            assert [n["site"] for n in got] == [mid]
            # Faults: one GPU a reset fixes; one that nothing fixes, held by an operator (stays contained).
            env.world.inject_fault(env.world.machine_by_name(joined[0]["node_name"])["id"], 1, "xid", 48, "reset")
            repaired = client.get_workflow_handle(f"repair/{joined[0]['node_name']}/gpu1")
            await _eventually(lambda: _exists(repaired))
            await asyncio.wait_for(repaired.result(), 60)
            held_node = got[0]["node_name"]
            env.world.inject_fault(env.world.machine_by_name(held_node)["id"], 0, "xid", 79, "never")
            held = client.get_workflow_handle(f"repair/{held_node}/gpu0")
            await _eventually(lambda: _exists(held))
            await held.execute_update("hold")
            # A machine nobody joined (the sweep's business), model routing, weights replicated twice.
            env.provider(dear).create_machine(
                MachineSpec(name=f"stray-{uid}", site=dear, region="r1", instance_type=f"dear.2xh100", gpu="H100",
                            gpus=2), f"stray-{uid}")
            env.cluster.apply_serving(ServingSpec(model="llama", site=cheap, image="vllm:1"))
            env.cluster.set_routing_weights("llama", {cheap: 70, mid: 30})
            env.cluster.set_site_routes({cheap: SiteRoute(weight=100), mid: SiteRoute(weight=100)})
            sizes = {"config.json": 1000, "w.safetensors": 70_000}
            await asyncio.to_thread(_replicate_twice, moto_s3, cheap, sizes)
            # A node left at a site the config no longer names (removed before it was empty).
            removed = f"removed-{uid}"
            env.cluster.create_join_token(f"{removed}-n1", f"m-{removed}", 600)
            env.cluster.register_with_token(f"m-{removed}", env.world.take_bootstrap_token(f"m-{removed}"), "b", 2)
            env.cluster.label_node(f"{removed}-n1", {LABEL_SITE: removed})

            q = f'site="{cheap}"'
            await prom.value(f'gpufleet_nodes{{{q},state="ready"}}', 2)
            await prom.value(f'gpufleet_nodes{{site="{mid}",state="cordoned"}}', 1)
            await prom.value(f'sum(gpufleet_nodes{{site="{dear}"}})', 0)
            await prom.value(f'gpufleet_gpus{{{q},state="healthy"}}', 4)
            await prom.value(f'gpufleet_gpus{{site="{mid}",state="contained"}}', 1)
            await prom.value(f'gpufleet_gpus{{site="{mid}",state="healthy"}}', 1)
            await prom.value('gpufleet_repairs{rung="reset",outcome="repaired"}', 1)
            await prom.value('sum(gpufleet_repairs{outcome="in-progress"})', 1)
            await prom.value(f'count(gpufleet_repair_in_progress{{node="{held_node}",gpu="0",site="{mid}"}})', 1)
            await prom.value(f'gpufleet_incidents_open{{{q}}}', 0)
            await prom.value(f'gpufleet_nodes_needing_a_person{{{q}}}', 0)
            await prom.value(f'gpufleet_capacity_attempts_total{{{q},provider="lambda",result="ok"}}', 2)
            await prom.value(f'gpufleet_capacity_attempts_total{{{q},result="OverQuota"}}', 1)
            await prom.value(f'gpufleet_capacity_attempts_total{{site="{mid}",provider="nebius",result="ok"}}', 1)
            await prom.value(f'gpufleet_account_needs_person{{account="a-{uid}",provider="lambda"}}', 1)
            await prom.value(f'sum(gpufleet_account_needs_person{{account=~".*-{uid}"}})', 1)
            await prom.value(f'gpufleet_spend_dollars_per_hour{{{q},provider="lambda"}}', 2 * 2 * 2.0)
            await prom.value(f'gpufleet_spend_dollars_per_hour{{site="{mid}"}}', 2 * 2.5)
            await prom.value(f'gpufleet_spend_dollars_per_hour{{site="{dear}",provider="aws"}}', 2 * 3.5)
            await prom.value(f'gpufleet_orphaned_machines{{site="{dear}"}}', 1)
            await prom.value(f'gpufleet_orphaned_machines{{{q}}}', 0)
            await prom.value(f'gpufleet_routing_weight{{model="llama",{q}}}', 70)
            await prom.value(f'gpufleet_routing_weight{{model="llama",site="{mid}"}}', 30)
            await prom.value(f'gpufleet_weights_replicated_bytes_total{{{q}}}', sum(sizes.values()))
            await prom.value(f'gpufleet_weights_verified_bytes_total{{{q}}}', 2 * sum(sizes.values()))
            await prom.value("gpufleet_node_agents_running", 3)
            await prom.value('min(gpufleet_source_up)', 1)
            await prom.value(f'gpufleet_site_not_configured{{site="{removed}"}}', 1)
            await prom.value('count(gpufleet_site_not_configured)', 1)
            # The SDK's own: workflow tasks were scheduled and started on this queue.
            sdk = prom.query(f'temporal_workflow_task_schedule_to_start_latency_seconds_count'
                             f'{{task_queue="{settings.task_queue}",service="control-plane"}}')
            assert sdk and max(sdk.values()) > 0, sdk
            assert prom.query(f'temporal_num_pollers{{task_queue="{settings.task_queue}"}}')

            # Everything the dashboard and the alerts name is in the scrape.
            names = prom.names()
            used = set().union(*(referenced_metrics(e) for e in dashboard_exprs()),
                               *(referenced_metrics(r["expr"]) for r in alert_rules()))
            assert used - names == set(), f"not in the scrape: {sorted(used - names)}"
            # The node agents' page loses nothing to their scrape's keep list and limits (an honest
            # agent's page sized them: this one is three agents', after joins and repairs).
            agents_page = urllib.request.urlopen(f"http://127.0.0.1:{agents_server.port}/metrics", timeout=10).read()
            served = {s.name for f in text_string_to_metric_families(agents_page.decode()) for s in f.samples}
            assert {"gpufleet_node_agents_running", "temporal_activity_execution_latency_seconds_bucket"} <= served
            await prom.value(f'up{{job="{NODE_AGENT_JOB}"}}', 1)

            async def agents_names_stored() -> bool:
                return served <= set(prom.api("label/__name__/values", **{"match[]": f'{{job="{NODE_AGENT_JOB}"}}'}))

            await _eventually(agents_names_stored)
            (samples,) = prom.query(f'scrape_samples_scraped{{job="{NODE_AGENT_JOB}"}}').values()
            assert samples < monitors["gpufleet-node-agent"]["spec"]["sampleLimit"] / 4, samples
            # The alerts see what happened: an account needs a person, an orphan exists, a node is
            # left at a site the config no longer names.
            await _eventually(lambda: _alerting(prom, {"GpufleetAccountNeedsPerson", "GpufleetOrphanedMachine",
                                                       "GpufleetSiteNotConfigured"}))
            await terminate_running(client, settings.task_queue)
    finally:
        REGISTRY.unregister(collector)
        stop.set()
        await host_task
        prom.stop()
        server.close()
        agents_server.close()


def _replicate_twice(s3, site: str, sizes: dict[str, int]) -> None:
    from activities.weights import Replicator
    from fleet.messages.rollout import ReplicateInput
    from fleet.rollout import Replication, WeightFile

    source = s3.bucket(s3.store(0))
    dest = s3.bucket(s3.store(1))
    files = put_files(s3, source, sizes)
    for _ in range(2):  # copied, then found with the right sha256
        input = ReplicateInput(site=site, source=source, files=[WeightFile(**f) for f in files],
                               dest_prefix="models/llama/v1/", options=Replication())
        Replicator(input, dest, s3.client(source), s3.client(dest)).run()


async def _exists(handle) -> bool:
    try:
        await handle.describe()
        return True
    except Exception:  # noqa: BLE001 - not started yet
        return False


async def _alerting(prom: Prometheus, names: set[str]) -> bool:
    # Pending counts: each rule waits its `for:` before firing.
    firing = {a["labels"]["alertname"] for a in prom.api("alerts")["alerts"] if a["state"] in ("pending", "firing")}
    return names <= firing


async def _eventually(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.2)


async def test_top_once_shows_the_sim_fleets_sites_and_counts(stack) -> None:
    handle = await stack.start_join({"site": "site-a", "count": 2})
    await handle.result()
    env = {**stack.settings_env(), "COLUMNS": "250"}
    shown = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", "top", "--once", "-o", "table"], env=env,
                                    capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in shown.stdout.splitlines() if line.startswith("│")}
    # provider, provisioning, unproven, ready, cordoned, not-ready, GPUs ok, contained, incidents, state, weight, $/h
    assert rows["site-a"][:8] == ["lambda", "0", "0", "2", "0", "0", "4", "0"]
    assert rows["site-a"][-1] == f"{2 * 2 * 2.5:.2f}"
    assert rows["site-b"][:8] == ["nebius", "0", "0", "0", "0", "0", "0", "0"]
    assert "nodes 2  GPUs 4 (0 contained)" in shown.stdout
    assert "unavailable" not in shown.stdout


@pytest.mark.timeout(120)
def test_dev_stack_workers_serve_their_metrics(tmp_path: Path) -> None:
    import os

    from tests.conftest import write_fleet
    from tests.test_dev_stack import start_dev, stop_dev

    port, ui_port = free_port(), free_port()
    env = {**os.environ, "GPUFLEET_STATE_DIR": str(tmp_path / "state"), "GPUFLEET_CONFIG": str(write_fleet(tmp_path)),
           "TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "COLUMNS": "200"}
    env.pop("GPUFLEET_TASK_QUEUE", None)
    env.pop("GPUFLEET_METRICS_PORT", None)
    dev = start_dev(env, port, ui_port, tmp_path / "dev.log")
    try:
        # Each worker prints its URL once it serves; under load that may come after the stack is up.
        deadline = time.monotonic() + 30
        while True:
            urls = re.findall(r"(http://127\.0\.0\.1:\d+/metrics)\s+\(([\w-]+)\)", (tmp_path / "dev.log").read_text())
            by_worker = {worker: url for url, worker in urls}
            if set(by_worker) >= {"control-plane", "node-agents"} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(by_worker) == {"control-plane", "node-agents"}
        deadline = time.monotonic() + 30
        while True:
            pages = {}
            for worker, url in by_worker.items():
                try:
                    pages[worker] = urllib.request.urlopen(url, timeout=10).read().decode()
                except OSError:
                    pass
            # The SDK's own metrics: pollers on the control plane. The node host (no nodes yet) holds no
            # Temporal connection at all: each node's agent connects through the node gateway as itself.
            if "temporal_num_pollers" in pages.get("control-plane", "") and "gpufleet_node_agents_running" in pages.get(
                    "node-agents", ""):
                break
            assert time.monotonic() < deadline, pages
            time.sleep(0.5)
        assert re.search(r'gpufleet_nodes\{provider="lambda",site="site-a",state="ready"\} 0', pages["control-plane"])
        assert 'service="control-plane"' in pages["control-plane"]
        assert "gpufleet_node_agents_running 0" in pages["node-agents"]
        # The SDK's series (tagged service="node-agent") start with the first node's connection.
    finally:
        stop_dev(dev)


@needs("promtool")
def test_a_node_claiming_a_million_agents_counts_as_one_on_the_dashboard(tmp_path: Path) -> None:
    """"Node agents running" sums what the agents serve: each node agent runs one agent, so a node
    that serves a million (it may serve anything) counts once, and a series in another job (one
    a node could put under the control plane's names) counts not at all."""
    (panel,) = [p for p in dashboard()["panels"] if p.get("title") == "Node agents running"]
    expr = panel["targets"][0]["expr"]
    series = [
        {"series": f'gpufleet_node_agents_running{{job="{NODE_AGENT_JOB}",instance="10.0.0.8:9465",node="gpu-8"}}',
         "values": "1x10"},
        {"series": f'gpufleet_node_agents_running{{job="{NODE_AGENT_JOB}",instance="10.0.0.9:9465",node="gpu-9"}}',
         "values": "1000000x10"},
        {"series": f'gpufleet_node_agents_running{{job="{CONTROL_PLANE_JOB}",instance="10.0.0.2:9464"}}',
         "values": "500x10"},
    ]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panel", "rules": [
        {"record": "gpufleet_dashboard:agents", "expr": expr}]}]}))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": [str(tmp_path / "rules.yaml")], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
            {"expr": "gpufleet_dashboard:agents", "eval_time": "5m",
             "exp_samples": [{"labels": "gpufleet_dashboard:agents", "value": 2}]}]}],
    }))
    tested = subprocess.run([require("promtool"), "test", "rules", str(tmp_path / "test.yaml")],
                            capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr
