"""The Prometheus Operator's objects gpufleet ships, on the real control plane with the operator's
own CRDs: `deploy/prometheus-operator` (the kustomize overlay) and the Helm chart's rendering with
`metrics.serviceMonitor.enabled`.

The CRDs are upstream's, generated from the operator's published API types by controller-gen as
upstream generates them (tests/prometheus_operator/build.py), so the API server checks each object
against the operator's real schema. Every apply asks for strict field validation: a field the
schema does not know (a misspelling) is refused. (Server-side apply refuses one anyway; a create or
update that does not ask for strict validation gets a warning, and the object is stored without it.)

Then what an operator does with the objects, read from the objects as the server would store them: the
ServiceMonitors' namespaces and selectors find every metrics Service, each once, and nothing else
(the node agents' with the limits and keep list of its own monitor), each found Service has the
endpoints' port and fronts a workload's container port of that name, the alert rules read the job
the control plane's monitor gives it, and the PrometheusRule and the ServiceMonitors carry the
labels the docs tell a Prometheus to select.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helm.chart import documents, key, template
from tests.prometheus_operator import build as crds
from tests.realk8s.cluster import ClusterFailed, RealCluster

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "prometheus-operator"
#: The operator's kinds gpufleet ships, by plural.
PLURALS = ("servicemonitors", "prometheusrules")
#: What deploy/prometheus-operator/prometheus-rule.yaml tells a Prometheus's ruleSelector (and its
#: serviceMonitorSelector) to match: the labels gpufleet's objects all carry.
DOCUMENTED_SELECTOR = {"matchLabels": {"app.kubernetes.io/part-of": "gpufleet"}}
#: kube-prometheus-stack's Prometheus by default (its *SelectorNilUsesHelmValues): its own release.
KUBE_PROMETHEUS_STACK_SELECTOR = {"matchLabels": {"release": "kube-prometheus-stack"}}
WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet")


@pytest.fixture(scope="module")
def monitoring_crds(real_cluster: RealCluster) -> RealCluster:
    """The operator's ServiceMonitor and PrometheusRule CRDs, installed and Established."""
    reason = crds.missing_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs every test: {reason}", pytrace=False)
        pytest.skip(reason)
    files = [arg for plural in PLURALS for arg in ("-f", str(crds.crd_path(plural)))]
    real_cluster.kubectl("apply", "--server-side", "--field-manager=prometheus-operator-crds", *files)
    wait = ("wait", "--for=condition=Established", "--timeout=60s",
            *(f"crd/{plural}.monitoring.coreos.com" for plural in PLURALS))
    for _ in range(20):
        done = real_cluster.kubectl(*wait, check=False)
        # kubectl's wait refuses at once a CRD whose status has no conditions yet, as one just created
        # may ("<nil> is of the type <nil>"), rather than wait for them: asked again.
        if done.returncode == 0 or ".status.conditions accessor error" not in done.stderr:
            break
        time.sleep(0.5)
    if done.returncode != 0:
        raise ClusterFailed(f"kubectl {' '.join(wait)}: {done.stderr.strip()}")
    return real_cluster


def apply_strictly(cluster: RealCluster, *source: str, manifest: str | None = None) -> list[dict[str, Any]]:
    """`kubectl apply --server-side` with strict field validation (an unknown or duplicated field
    is an error, not dropped), as a server-side dry run: every object validated and admitted as
    the create or update it would be, and returned as the server would store it, while the base's
    live objects stay as the tier's other tests left them (whichever manager owns their fields)."""
    done = cluster.kubectl("apply", "--server-side", "--validate=strict", "--dry-run=server", "--force-conflicts",
                           "--field-manager=gpufleet-monitoring-check", "-o", "json", *source, input=manifest)
    answer = json.loads(done.stdout)
    return answer["items"] if answer.get("kind") == "List" else [answer]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector, as the operator evaluates it: every matchLabels pair and every
    matchExpressions term holds (an empty selector selects everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for term in selector.get("matchExpressions") or []:
        has, value, values = term["key"] in labels, labels.get(term["key"]), term.get("values") or []
        held = {"In": has and value in values, "NotIn": not has or value not in values,
                "Exists": has, "DoesNotExist": not has}[term["operator"]]
        if not held:
            return False
    return True


def monitored_namespaces(monitor: dict[str, Any], all_namespaces: set[str]) -> set[str]:
    """The namespaces a ServiceMonitor's Services are looked for in: ``any``, the names it lists,
    else its own namespace."""
    chosen = monitor["spec"].get("namespaceSelector") or {}
    if chosen.get("any"):
        return all_namespaces
    return set(chosen.get("matchNames") or [monitor["metadata"]["namespace"]])


def assert_a_prometheus_operator_finds_the_workers(
        objects: list[dict[str, Any]], prometheus_selects: tuple[dict[str, Any], ...] = (DOCUMENTED_SELECTOR,)) -> None:
    """What the operator's scrape configuration relies on, followed from the ServiceMonitors to the
    containers: each metrics Service is found by exactly one ServiceMonitor in its namespaces, and
    no Service without a metrics port is; each found Service has every endpoint's port, and that
    port reaches a container port of that name in a workload the Service selects. The node agents'
    Service is found by the monitor with the per-scrape limits and a keep list, the control plane's
    by one that gives it the job the PrometheusRule's expressions select. A Prometheus whose
    serviceMonitorSelector and ruleSelector are each of ``prometheus_selects`` picks up the
    ServiceMonitors and the PrometheusRule."""
    def of_kind(kind: str) -> list[dict[str, Any]]:
        return [o for o in objects if o["kind"] == kind]

    monitors = of_kind("ServiceMonitor")
    (rule,) = of_kind("PrometheusRule")
    services = of_kind("Service")
    workloads = [o for o in objects if o["kind"] in WORKLOAD_KINDS]
    assert monitors, "the shipped objects hold ServiceMonitors"
    ports = {e["port"] for monitor in monitors for e in monitor["spec"]["endpoints"]}
    assert all(ports), "a ServiceMonitor endpoint names the Service port it scrapes"
    metrics_services = {s["metadata"]["name"] for s in services
                        if {p.get("name") for p in s["spec"]["ports"]} & ports}
    assert metrics_services, "the shipped objects hold the Services the ServiceMonitors are for"
    all_namespaces = {o["metadata"].get("namespace", "") for o in objects}
    found_by: dict[str, list[dict[str, Any]]] = {}
    for monitor in monitors:
        namespaces = monitored_namespaces(monitor, all_namespaces)
        for service in services:
            if service["metadata"]["namespace"] in namespaces and \
                    selects(monitor["spec"]["selector"], service["metadata"].get("labels") or {}):
                found_by.setdefault(service["metadata"]["name"], []).append(monitor)
                assert_the_port_reaches_a_container(monitor, service, workloads)
    assert set(found_by) == metrics_services, \
        "the ServiceMonitors find every metrics Service, and no Service without its port"
    assert all(len(found) == 1 for found in found_by.values()), \
        {name: [m["metadata"]["name"] for m in found] for name, found in found_by.items()}
    ((agents,),) = [found for name, found in found_by.items() if name.startswith("gpufleet-node-agent")]
    assert all(agents["spec"].get(limit) for limit in ("sampleLimit", "labelLimit", "labelNameLengthLimit",
                                                       "labelValueLengthLimit", "bodySizeLimit"))
    assert [r["action"] for e in agents["spec"]["endpoints"] for r in e["metricRelabelings"]] == ["keep"]
    ((control_plane,),) = [found for name, found in found_by.items() if name.startswith("gpufleet-control-plane")]
    (service,) = [s for s in services if s["metadata"]["name"].startswith("gpufleet-control-plane")]
    job = service["metadata"]["labels"][control_plane["spec"]["jobLabel"]]
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert all(f'job="{job}"' in expr for expr in exprs), f"every alert reads job {job}"
    for selector in prometheus_selects:
        for obj in (*monitors, rule):
            assert selects(selector, obj["metadata"].get("labels") or {}), f"{key(obj)}: not selected by {selector}"
    assert rule["spec"]["groups"] and all(g["rules"] for g in rule["spec"]["groups"])


def assert_the_port_reaches_a_container(monitor: dict[str, Any], service: dict[str, Any],
                                        workloads: list[dict[str, Any]]) -> None:
    for port in (e["port"] for e in monitor["spec"]["endpoints"]):
        (spec,) = [p for p in service["spec"]["ports"] if p.get("name") == port]
        # The operator scrapes the endpoints behind the port: pods the Service selects, with a
        # container port the targetPort names (a number would reach any container's port).
        pods = [w["spec"]["template"] for w in workloads
                if w["metadata"]["namespace"] == service["metadata"]["namespace"]
                and service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"{service['metadata']['name']} selects a shipped workload's pods"
        container_ports = {cp.get("name") for pod in pods for c in pod["spec"]["containers"]
                           for cp in c.get("ports") or []}
        assert isinstance(spec["targetPort"], int) or spec["targetPort"] in container_ports, \
            f"{service['metadata']['name']}: targetPort {spec['targetPort']} names a container port"


def test_the_prometheus_operator_overlay_applies_strictly_and_finds_the_workers(monitoring_crds: RealCluster) -> None:
    """`kubectl apply -k deploy/prometheus-operator`, as the docs say, with strict validation: the
    base it includes is live already (the conftest applied it), the operator's two objects are new."""
    stored = apply_strictly(monitoring_crds, "-k", str(OVERLAY))
    shipped = documents(monitoring_crds.kubectl("kustomize", str(OVERLAY)).stdout)
    assert {key(o) for o in stored} == {key(o) for o in shipped}
    for obj in stored:
        if obj["kind"] in ("ServiceMonitor", "PrometheusRule"):
            # Stored as shipped: the schema kept every field (nothing pruned, nothing renamed).
            (sent,) = [o for o in shipped if key(o) == key(obj)]
            assert obj["spec"] == sent["spec"], key(obj)
    assert_a_prometheus_operator_finds_the_workers(stored)


def test_the_charts_monitoring_objects_apply_strictly_and_find_the_workers(monitoring_crds: RealCluster) -> None:
    """The chart with its ServiceMonitor on, every object of the rendering, with strict validation;
    with the label kube-prometheus-stack's selectors want by default, which the docs say to add."""
    rendered = template("--set", "metrics.serviceMonitor.enabled=true",
                        "--set", "metrics.serviceMonitor.labels.release=kube-prometheus-stack")
    kinds = {o["kind"] for o in documents(rendered)}
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds, f"the chart renders both: {sorted(kinds)}"
    stored = apply_strictly(monitoring_crds, "-f", "-", manifest=rendered)
    assert {key(o) for o in stored} == {key(o) for o in documents(rendered)}
    assert_a_prometheus_operator_finds_the_workers(stored, (DOCUMENTED_SELECTOR, KUBE_PROMETHEUS_STACK_SELECTOR))


@pytest.mark.parametrize(("name", "shipped", "broken", "refused"), [
    # A misspelt field: a create or update without strict validation would store the object
    # without it, and the scrapes would run with the operator's default timeout.
    ("servicemonitor.yaml", "scrapeTimeout: 20s", "scrapeTimout: 20s",
     ".spec.endpoints[0].scrapeTimout: field not declared in schema"),
    # A value the schema refuses: Prometheus's durations have no spaces.
    ("prometheus-rule.yaml", "for: 45m", "for: 45 minutes", "spec.groups[0].rules[2].for"),
], ids=["misspelt-field", "bad-duration"])
def test_a_broken_copy_of_a_shipped_file_is_refused_naming_the_field(
        monitoring_crds: RealCluster, name: str, shipped: str, broken: str, refused: str) -> None:
    """The check above can fail: a copy of the shipped file with one mistake is refused."""
    text = (OVERLAY / name).read_text()
    assert text.count(shipped) == 1
    apply_strictly(monitoring_crds, "-f", "-", manifest=text)
    with pytest.raises(ClusterFailed, match=re.escape(refused)):
        apply_strictly(monitoring_crds, "-f", "-", manifest=text.replace(shipped, broken))

