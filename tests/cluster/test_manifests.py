"""deploy/kubernetes/ against the adapter: RBAC grants exactly ``ACCESS``, the serving / HTTPRoute
templates are what the adapter renders, and the largest manifest a rollout takes fits a
Deployment's annotations."""

from __future__ import annotations

import json
from pathlib import Path
from string import Template

import pytest
import yaml

from providers.cluster.base import ANNOTATION_MODEL, dns_label, serving_name
from fleet.cluster import ANNOTATION_PREVIOUS_TEMPLATE, ANNOTATION_TEMPLATE, ServingSpec, SiteRoute
from fleet.config import ObjectStore, load_config
from fleet.models import CredentialsRef
from providers.credentials import credential_references, credentials_role, read_by_the_control_plane
from fleet.rollout import POD_TEMPLATE_BUDGET, RolloutInput, WeightFile, manifest_template_bytes
from fleet.weights_pull import ENV as WEIGHTS_ENV
from fleet.weights_pull import WeightsPull
from providers.cluster.kubernetes import access_table, render_deployment, render_service
from providers.cluster.envoy_gateway import render_httproute
from tests.helm.chart import containers, package_version
from tests.realk8s.image import CONTAINERFILES, Containerfile

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _granted(docs: list[dict], purpose: str) -> set[tuple[str, str, str, str, str]]:
    granted = set()
    for doc in docs:
        if doc["kind"] not in ("Role", "ClusterRole"):
            continue
        if doc["metadata"].get("labels", {}).get("gpufleet.io/rbac-for") != purpose:
            continue
        namespace = doc["metadata"].get("namespace", "") if doc["kind"] == "Role" else ""
        for rule in doc["rules"]:
            # Only signers are named: approving is limited to the kubelet signers.
            assert "resourceNames" not in rule or rule["resources"] == ["signers"]
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    base, _, sub = resource.partition("/")
                    for verb in rule["verbs"]:
                        granted.add((verb, group, base, sub, namespace))
    return granted


def test_rbac_grants_exactly_the_adapters_verbs():
    granted = _granted(_docs("rbac.yaml"), "cluster-adapter")
    used = {(r.verb, r.group, r.resource, r.subresource, r.namespace) for r in access_table("gpufleet")}
    assert granted - used == set(), "granted but never used"
    assert used - granted == set(), "used but not granted"


def test_every_adapter_role_is_bound_to_the_control_plane():
    docs = _docs("rbac.yaml")
    roles = {(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace", "")) for d in docs
             if d["kind"] in ("Role", "ClusterRole")
             and d["metadata"].get("labels", {}).get("gpufleet.io/rbac-for") == "cluster-adapter"}
    bound = set()
    for doc in docs:
        if doc["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if {"kind": "ServiceAccount", "name": "gpufleet-control-plane", "namespace": "gpufleet"} in doc["subjects"]:
            ref = doc["roleRef"]
            bound.add((ref["kind"], ref["name"], doc["metadata"].get("namespace", "")))
    assert roles <= bound
    accounts = {(d["metadata"]["name"], d["metadata"]["namespace"]) for d in docs if d["kind"] == "ServiceAccount"}
    assert accounts == {("gpufleet-control-plane", "gpufleet"), ("gpufleet-node-agent", "gpufleet")}


def test_the_node_gateway_may_only_read_a_node_and_its_identity_record():
    """Its one cluster call is the per-call liveness check (``get_node``: the Node, then its
    identity ConfigMap); a gateway is internet-facing, so it gets nothing more."""
    granted = _granted(_docs("node-gateway.yaml"), "node-gateway")
    assert granted == {("get", "", "nodes", "", ""), ("get", "", "configmaps", "", "gpufleet")}
    used = {(r.verb, r.group, r.resource, r.subresource, r.namespace) for r in access_table("gpufleet")
            if "get_node" in r.purpose or "control-plane state" in r.purpose and r.verb == "get"}
    assert granted == used
    (deployment,) = [d for d in _docs("node-gateway.yaml") if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpufleet-node-gateway"
    (container,) = pod["containers"]
    assert container["command"][:3] == ["python", "-m", "workers.node_gateway"]
    for flag in ("--cert", "--key", "--client-ca"):
        assert flag in container["command"]
    env = {e["name"] for e in container["env"]}
    assert {"TEMPORAL_ADDRESS", "GPUFLEET_CONFIG"} <= env, "the control plane's settings and the cluster"


def test_the_node_gateways_replicas_each_take_their_part_of_the_upstream_budget():
    """Each replica sends the frontend its part of ``GPUFLEET_GATEWAY_UPSTREAM_CALLS_PER_SECOND``
    (``NodeGatewayEnv.replica_upstream_calls_per_second``): the manifest tells them how many they
    are, so that together they send no more than the whole budget."""
    from fleet.settings import NodeGatewayEnv

    (deployment,) = [d for d in _docs("node-gateway.yaml") if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    rates = NodeGatewayEnv.from_env(env)
    assert rates.replicas == deployment["spec"]["replicas"]
    assert rates.replica_upstream_calls_per_second * rates.replicas == rates.upstream_calls_per_second


def test_every_node_gateway_replica_mounts_the_one_task_token_key():
    """Each replica binds the task tokens it hands a node with the key of the Secret
    gpufleet-node-gateway-token-key, mounted where GPUFLEET_GATEWAY_TOKEN_KEYS (fleet/settings.py)
    says: so any replica, and a restarted one, takes a node's answers. Not optional: without the
    Secret the pods wait for it, rather than start with keys of their own. Every test gateway reads
    its keys through this mount (tests/gateway_keys.py)."""
    from fleet.settings import NodeGatewayEnv
    from tests.gateway_keys import TOKEN_KEY_SECRET, gateway_container_and_volumes, token_key_mount

    variable, path = token_key_mount()
    assert variable == NodeGatewayEnv.variable("token_keys")
    container, volumes = gateway_container_and_volumes()
    (volume,) = [v for v in volumes if v.get("secret", {}).get("secretName") == TOKEN_KEY_SECRET]
    assert not volume["secret"].get("optional") and "items" not in volume["secret"], "current and previous, both"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    assert mount["readOnly"] is True


def policy_admits(policy: dict, port: int, namespace: str | None, labels: dict[str, str]) -> bool:
    """Whether the ingress NetworkPolicy ``policy`` admits a connection to ``port`` of the pods it
    selects from a pod of ``namespace`` with ``labels``, or from a host (``namespace`` None: a GPU
    node's own address, no pod's). Only what gpufleet's policies use: a rule with no ``from``
    admits anyone; a peer is a ``podSelector`` of matchLabels, in the policy's namespace or, with a
    ``namespaceSelector`` of the namespace's name label, in that one."""
    for rule in policy["spec"].get("ingress") or []:
        if "ports" in rule and port not in {p["port"] for p in rule["ports"] if p.get("protocol", "TCP") == "TCP"}:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            assert set(peer) <= {"podSelector", "namespaceSelector"} and "podSelector" in peer, f"teach this: {peer}"
            assert set(peer["podSelector"]) == {"matchLabels"}, f"teach this: {peer}"
            where = policy["metadata"]["namespace"]
            if "namespaceSelector" in peer:
                names = peer["namespaceSelector"]
                assert set(names) == {"matchLabels"} and set(names["matchLabels"]) == {"kubernetes.io/metadata.name"}, \
                    f"teach this: {peer}"
                where = names["matchLabels"]["kubernetes.io/metadata.name"]
            if namespace == where and peer["podSelector"]["matchLabels"].items() <= labels.items():
                return True
    return False


def test_only_the_gateways_own_pods_reach_its_peer_port_and_anyone_its_node_port():
    """The peer port served every node's name and call rate, and sealed the report anew, for
    anyone who reached a gateway pod's address: a GPU node's host or pods included. The gateway's
    NetworkPolicy admits the peer port from the gateway's own pods in gpufleet only, and leaves its
    node port (the nodes' endpoint, through a LoadBalancer that keeps their addresses) and its
    metrics port open as before: every port the gateway's container serves is in it."""
    from fleet.settings import NodeGatewayEnv

    docs = _docs("node-gateway.yaml")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert int(NodeGatewayEnv.from_env(env).peers.rpartition(":")[2]) == ports["peers"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["namespace"] == deployment["metadata"]["namespace"] == "gpufleet"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"], "every gateway pod"

    gateway = template["metadata"]["labels"]
    (agent,) = [d for d in _docs("node-agent.yaml") if d["kind"] == "DaemonSet"]
    agent_labels = agent["spec"]["template"]["metadata"]["labels"]
    assert policy_admits(policy, ports["peers"], "gpufleet", gateway)
    for who, namespace, labels in (("a GPU node's host", None, {}),
                                   ("a node agent", "gpufleet", agent_labels),
                                   ("a pod labelled as the gateway elsewhere", "default", gateway)):
        assert not policy_admits(policy, ports["peers"], namespace, labels), who
        for name in ("nodes", "metrics"):
            assert policy_admits(policy, ports[name], namespace, labels), (who, name)
    assert set(ports) == {"nodes", "peers", "metrics"}, "a new port: say who may reach it"


#: The labels the Prometheus Operator gives the pods of a Prometheus (kube-prometheus-stack's
#: included) and the prometheus-community chart's server, as far as the control plane's policy reads them.
PROMETHEUS_POD = {"app.kubernetes.io/name": "prometheus", "app.kubernetes.io/managed-by": "prometheus-operator",
                  "app.kubernetes.io/instance": "k8s", "prometheus": "k8s"}


def test_only_prometheus_reaches_the_control_planes_metrics_port_and_nothing_its_other_ports():
    """The control plane's /metrics page is served by the process that runs the fleet's workflows,
    and any pod or host could dial it: a GPU node's own, or its pods' (a node exporter, its model
    servers). Its NetworkPolicy admits the metrics port from Prometheus's pods in `monitoring`
    only, and no other port from anyone. (Enforcement is the CNI's; none runs in these tests:
    tests/realk8s/test_control_plane_access.py has the real API server evaluate the selectors.)"""
    docs = _docs("control-plane.yaml")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["namespace"] == deployment["metadata"]["namespace"] == "gpufleet"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"], "every control-plane pod"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert set(ports) == {"metrics"}, "a new port: say who may reach it"
    (service,) = [d for d in _docs("monitoring.yaml") if d["metadata"]["name"] == "gpufleet-control-plane-metrics"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"

    assert policy_admits(policy, ports["metrics"], "monitoring", PROMETHEUS_POD)
    (agent,) = [d for d in _docs("node-agent.yaml") if d["kind"] == "DaemonSet"]
    server = render_deployment(ServingSpec(model="m", site="site-a", image="i"), "gpufleet")
    for who, namespace, labels in (
            ("a GPU node's host", None, {}),
            ("a node agent", "gpufleet", agent["spec"]["template"]["metadata"]["labels"]),
            ("a model server", "gpufleet", server["spec"]["template"]["metadata"]["labels"]),
            ("another pod of monitoring (a node exporter on every GPU node)", "monitoring",
             {"app.kubernetes.io/name": "prometheus-node-exporter"}),
            ("a pod labelled as Prometheus elsewhere", "default", PROMETHEUS_POD),
            ("the control plane itself", "gpufleet", deployment["spec"]["template"]["metadata"]["labels"])):
        assert not policy_admits(policy, ports["metrics"], namespace, labels), who
    for port in (7233, 8000, 9465, 9466):
        assert not policy_admits(policy, port, "monitoring", PROMETHEUS_POD), port


def test_control_plane_deployment():
    (deployment,) = [d for d in _docs("control-plane.yaml") if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpufleet-control-plane"
    (container,) = pod["containers"]
    assert container["image"] == f"gpufleet-control-plane:{package_version()}"
    assert container["command"] == ["python", "-m", "workers.control_plane"]
    env = {e["name"] for e in container["env"]}
    assert {"TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "GPUFLEET_TASK_QUEUE", "GPUFLEET_CONFIG"} <= env


#: The fleet configs gpufleet ships for an operator to copy into the ConfigMap gpufleet-config.
SHIPPED_CONFIGS = [DEPLOY.parent / "sites.example.yaml"]


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_every_credential_a_shipped_config_names_resolves_in_the_shipped_control_plane_pod(path):
    """An operator who copies the example and applies deploy/kubernetes (or the chart: the same
    Deployment, tests/test_helm.py) gets no BadCredentials on an account's first call, which
    marks the account credentials-revoked and pages. In the pod as shipped an ``env:`` resolves
    only if the container sets the variable, a ``file:`` only under a Secret the pod mounts, a
    ``secret:`` only in full (a Secret's key, no default) where the credentials Role that
    ``gpufleet cluster credentials-role`` renders from the config grants get, by its name;
    tests/realk8s/test_permissions.py asks the real authorizer about each Secret."""
    (deployment,) = [d for d in _docs("control-plane.yaml") if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"] for e in container["env"]}
    secret_volumes = {v["name"] for v in pod["volumes"] if "secret" in v or "projected" in v}
    secret_mounts = [Path(m["mountPath"]) for m in container["volumeMounts"] if m["name"] in secret_volumes]
    config = load_config(path)
    role, _ = credentials_role(config)
    readable = {(role["metadata"]["namespace"], name) for rule in role["rules"] if rule["verbs"] == ["get"]
                and rule["resources"] == ["secrets"] for name in rule["resourceNames"]}
    references = credential_references(config)
    assert references, "the example names its credentials"
    unresolved = []
    for where, ref in references:
        if not read_by_the_control_plane(where):
            continue
        if ref.env:
            ok = ref.env in env
        elif ref.file:
            ok = any(Path(ref.file).is_relative_to(mount) for mount in secret_mounts)
        else:
            namespace, name, key = ref.secret_location()
            ok = bool(name and key) and (namespace, name) in readable
        if not ok:
            unresolved.append(f"{where}: {ref.describe()}")
    assert unresolved == [], "does not resolve in the shipped control-plane pod"


def every_reference_config(tmp_path: Path) -> Path:
    """The example with a ``secret:`` reference in every place a config holds one: the webhook,
    a site's own object store, two accounts sharing a Secret (two keys), and the node gateway's
    CA (which ``gpufleet cluster node-config`` reads with the operator's credentials, never the
    control plane); plus an ``env:`` reference, which needs no Secret."""
    raw = yaml.safe_load(SHIPPED_CONFIGS[0].read_text())
    raw["notify_webhook"] = {"secret": "gpufleet/pager-webhook#url"}
    raw["node_gateway"] = {"endpoint": "gateway.fleet.example.com:443", "ca": {"secret": "gpufleet/gateway-ca#ca.crt"}}
    raw["object_stores"]["scratch"] = {"bucket": "scratch", "credentials": {"env": "SCRATCH_KEYS"}}
    site = next(s for s in raw["sites"] if s["name"] == "nebius-eu-north")
    # Its nodes' read-only key too, which only they read (a serving pod names it): no Role names it.
    site["object_store"] = {"bucket": "nebius-cache", "credentials": {"secret": "gpufleet/nebius-store#credentials"},
                            "pull_credentials": {"secret": "gpufleet/nebius-store-read#credentials"}}
    shared = next(a for a in raw["accounts"] if a["name"] == "hetzner-prod")
    raw["accounts"].append({**shared, "name": "hetzner-staging", "credentials": {"secret": "gpufleet/hetzner-prod#staging"}})
    path = tmp_path / "every-reference.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


#: What ``every_reference_config`` names that the control plane reads.
EVERY_REFERENCE_SECRETS = ["aws-prod", "bmc", "hetzner-prod", "lambda-prod", "nebius-prod", "nebius-store",
                           "pager-webhook", "weights-source"]


def _secret_rules(docs: list[dict]) -> list[dict]:
    return [rule for doc in docs if doc["kind"] in ("Role", "ClusterRole") for rule in doc["rules"]
            if {"secrets", "*"} & set(rule["resources"])]


def test_the_credentials_role_lets_the_control_plane_get_the_secrets_its_config_names_and_no_other(tmp_path):
    """The base grants no Secret in `gpufleet` at all; the Role ``gpufleet cluster credentials-role``
    renders grants ``get`` on each Secret the config names, by name (never list or watch, and
    never the node gateway's CA, which the control plane does not read), bound to the control
    plane's service account. A config that names none gets a Role with no rules: an empty
    resourceNames would be every Secret."""
    granting = {(d["kind"], d["metadata"].get("namespace", "")) for d in _docs("rbac.yaml") if _secret_rules([d])}
    assert granting == {("Role", "kube-system"), ("Role", "gpufleet-bootstrap")}, "none in gpufleet, none cluster-wide"

    role, binding = credentials_role(load_config(every_reference_config(tmp_path)))
    assert (role["kind"], role["metadata"]["name"], role["metadata"]["namespace"]) == (
        "Role", "gpufleet-credentials", "gpufleet")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": EVERY_REFERENCE_SECRETS,
                              "verbs": ["get"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "gpufleet-credentials"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpufleet-control-plane", "namespace": "gpufleet"}]
    assert binding["metadata"]["namespace"] == "gpufleet"

    none = tmp_path / "none.yaml"
    none.write_text("mode: real\naccounts: [{name: la, provider: lambda, credentials: {env: LAMBDA_KEY}}]\n")
    role, _ = credentials_role(load_config(none))
    assert role["rules"] == []


def test_a_secret_outside_gpufleet_is_refused_naming_the_field(tmp_path):
    """The control plane reads Secrets in its own namespace only: a reference elsewhere (kube-system
    above all) would need a grant there, so the Role is not rendered and the field is named."""
    from fleet.config import ConfigError

    raw = yaml.safe_load(SHIPPED_CONFIGS[0].read_text())
    raw["accounts"][1]["credentials"] = {"secret": "kube-system/lambda-prod#api-key"}
    raw["notify_webhook"] = {"secret": "gpufleet/#url"}
    path = tmp_path / "elsewhere.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as raised:
        credentials_role(load_config(path), str(path))
    assert [p.split(":")[0] for p in raised.value.problems] == ["notify_webhook", "accounts.lambda-prod.credentials"]


def test_the_cli_prints_the_credentials_role_to_apply(tmp_path):
    from typer.testing import CliRunner

    from cli.cluster import cluster_app

    runner = CliRunner()
    path = every_reference_config(tmp_path)
    done = runner.invoke(cluster_app, ["credentials-role", "--config", str(path)])
    assert done.exit_code == 0, done.output
    assert list(yaml.safe_load_all(done.stdout)) == credentials_role(load_config(path))
    path.write_text(path.read_text().replace("gpufleet/lambda-prod#api-key", "default/lambda-prod#api-key"))
    done = runner.invoke(cluster_app, ["credentials-role", "--config", str(path)])
    assert done.exit_code == 2 and "accounts.lambda-prod.credentials" in done.output, done.output


def test_the_credentials_role_is_never_rendered_from_the_built_in_fleet(monkeypatch):
    """Without a config other commands run the built-in simulated fleet, which names no Secret:
    its Role, applied over the real one, would take every credential read from the control plane
    (each account then BadCredentials until rotated by hand)."""
    from typer.testing import CliRunner

    from cli.cluster import cluster_app
    from fleet.settings import CONFIG_ENV

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    done = CliRunner().invoke(cluster_app, ["credentials-role"])
    assert done.exit_code == 2 and "--config sites.yaml" in done.output, done.output
    assert "kind: Role" not in done.output


def test_node_agent_daemonset_runs_on_gpu_nodes_including_unproven():
    (daemonset,) = _docs("node-agent.yaml")
    assert daemonset["kind"] == "DaemonSet"
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpufleet-node-agent"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.present", "node-restriction.kubernetes.io/gpufleet-site"}
    assert {"key": "gpufleet.io/unproven", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (container,) = pod["containers"]
    assert container["image"] == f"gpufleet-node-agent:{package_version()}"
    assert container["command"] == ["python", "-m", "workers.node_agent", "--node-name", "$(NODE_NAME)",
                                    "--cert", "/var/lib/kubelet/pki/kubelet-client-current.pem"]
    # The kubelet's client certificate is the agent's identity at the gateway: its folder is mounted.
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/var/lib/kubelet/pki")
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == "/var/lib/kubelet/pki"
    assert pod["automountServiceAccountToken"] is False, "the agent calls no Kubernetes API"
    node_name = next(e for e in container["env"] if e["name"] == "NODE_NAME")
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Spot notices of the node's own provider, named in the providerID in kubeadm's flags.
    assert {"name": "GPUFLEET_SPOT_NOTICE", "value": "auto"} in container["env"]
    flags = next(m for m in container["volumeMounts"] if m["mountPath"] == "/var/lib/kubelet/kubeadm-flags.env")
    assert flags["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == flags["name"])
    assert volume["hostPath"] == {"path": "/var/lib/kubelet/kubeadm-flags.env", "type": "FileOrCreate"}


def test_a_workers_settings_are_its_manifests_alone_metrics_port_included():
    """A container's environment is its image's ENV under its manifest's ``env``: a GPUFLEET_*
    setting baked into an image applies wherever a manifest leaves it out, as the metrics port
    did under the chart's ``metrics.enabled: false`` (the workers served /metrics on ports no
    manifest declared). So no image sets one, and each worker that declares a metrics port
    sets it, and one that declares none serves none."""
    for path in sorted(CONTAINERFILES.glob("Containerfile.*")):
        baked = sorted(name for name in Containerfile.read(path.name.removeprefix("Containerfile.")).env
                       if name.startswith("GPUFLEET_"))
        assert baked == [], f"{path.name} sets {', '.join(baked)}: the manifests' to set"
    (kustomization,) = _docs("kustomization.yaml")
    workers = [c for name in kustomization["resources"] for d in _docs(name) for c in containers(d)
               if c["image"].startswith("gpufleet-")]
    assert {c["name"] for c in workers} >= {"worker", "agent", "gateway"}
    for container in workers:
        declared = [str(p["containerPort"]) for p in container.get("ports", []) if p["name"] == "metrics"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        set_port = [env["GPUFLEET_METRICS_PORT"]] if "GPUFLEET_METRICS_PORT" in env else []
        assert set_port == declared, f"{container['name']}: serves /metrics on {set_port}, declares {declared}"


def test_kustomization_lists_the_applied_files():
    (kustomization,) = _docs("kustomization.yaml")
    for name in kustomization["resources"]:
        assert (DEPLOY / name).exists()
    assert "serving-template.yaml" not in kustomization["resources"]


@pytest.mark.parametrize("model", ["llama-3-8b", "meta-llama/Llama-3.1-70B"])
def test_serving_template_is_what_the_adapter_renders(model):
    spec = ServingSpec(model=model, site="aws-use1", image="vllm/vllm-openai:v0.6.3", replicas=3,
                       gpus_per_replica=8, args=["--tensor-parallel-size", "8"], weights_path="/models/w", port=8080)
    text = Template((DEPLOY / "serving-template.yaml").read_text()).substitute(
        NAME=serving_name(model, spec.site), NAMESPACE="gpufleet", MODEL=json.dumps(model),
        MODEL_LABEL=dns_label(model), SITE=spec.site, REPLICAS=spec.replicas, IMAGE=spec.image,
        ARGS_JSON=json.dumps(spec.args), WEIGHTS_PATH=spec.weights_path, PORT=spec.port,
        GPUS=spec.gpus_per_replica,
    )
    deployment, service = [d for d in yaml.safe_load_all(text) if d]
    rendered = render_deployment(spec, "gpufleet")
    del rendered["metadata"]["annotations"][ANNOTATION_TEMPLATE]
    assert deployment == rendered
    assert service == render_service(model, spec.site, "gpufleet")


def test_httproute_template_is_what_the_adapter_renders():
    model = "llama-3-8b"
    sites = {"aws-use1": SiteRoute(weight=70), "hetzner-fsn1": SiteRoute(weight=30)}
    text = Template((DEPLOY / "httproute-template.yaml").read_text()).substitute(
        MODEL=model, MODEL_LABEL=dns_label(model), NAMESPACE="gpufleet", GATEWAY="gpufleet",
        SERVICE_A=serving_name(model, "aws-use1"), WEIGHT_A=70,
        SERVICE_B=serving_name(model, "hetzner-fsn1"), WEIGHT_B=30,
    )
    (route,) = [d for d in yaml.safe_load_all(text) if d]
    assert route == render_httproute(model, sites, "gpufleet", "gpufleet", "gpufleet")


def largest_manifest() -> list[WeightFile]:
    """The most shards a rollout takes: one more and its manifest passes ``POD_TEMPLATE_BUDGET``."""
    files: list[WeightFile] = []
    while True:
        shard = WeightFile(path=f"model-{len(files):05d}-of-99999.safetensors", size=5 * 10**9, sha256="a" * 64)
        if manifest_template_bytes([*files, shard]) > POD_TEMPLATE_BUDGET:
            return files
        files.append(shard)


def rollout_spec(files: list[WeightFile], version: str, model: str = "m" * 128, site: str = "s" * 54) -> ServingSpec:
    """What ModelRollout asks a site for (workflows/rollout.py ``_update_site``), with the longest
    names a rollout takes and a site store whose fields are long."""
    store = ObjectStore(endpoint_url=f"https://{'e' * 200}.example.com", bucket="b" * 63, prefix="p" * 200 + "/",
                        credentials=CredentialsRef(secret="gpufleet/weights-store#credentials"))
    prefix = f"{store.prefix}models/{model}/{version}/"
    env = {"MODEL_NAME": model, "MODEL_VERSION": version, "WEIGHTS_URI": f"s3://{store.bucket}/{prefix}",
           "AWS_ENDPOINT_URL_S3": store.endpoint_url}
    return ServingSpec(model=model, site=site, image="vllm/vllm-openai:v0.6.3", replicas=1, env=env,
                       weights_path=f"/models/{model}/{version}",
                       weights=WeightsPull(model=model, version=version, store=store, prefix=prefix, files=files))


#: The annotations the deployment controller adds to a Deployment and its ReplicaSets, at their longest.
CONTROLLER_ANNOTATIONS = {"deployment.kubernetes.io/revision": "9" * 19,
                          "deployment.kubernetes.io/desired-replicas": "9" * 10,
                          "deployment.kubernetes.io/max-replicas": "9" * 10}


def test_the_largest_manifest_a_rollout_takes_fits_a_deployment_with_the_one_before():
    """A rollout's second version: the Deployment (and its ReplicaSet) holds both templates in its
    annotations, which Kubernetes caps at 256 KiB in all; the manifest, one environment variable
    of the weights step, stays under Linux's 128 KiB for one."""
    files = largest_manifest()

    def request(shards: list[WeightFile]) -> dict:
        return {"model": "m" * 128, "version": "v" * 128, "image": "vllm/vllm-openai:v0.6.3",
                "sites": [{"site": "s" * 54, "replicas": 1}],
                "weights": {"source": {"store": "src"}, "files": [f.model_dump() for f in shards]}}

    RolloutInput.model_validate(request(files))
    with pytest.raises(ValueError, match="weights.files"):
        RolloutInput.model_validate(request([*files, WeightFile(path="extra.safetensors", size=1, sha256="a" * 64)]))

    before = render_deployment(rollout_spec(files, "1" * 128), "gpufleet")["metadata"]["annotations"]
    after = render_deployment(rollout_spec(files, "2" * 128), "gpufleet")
    annotations = {**after["metadata"]["annotations"], ANNOTATION_PREVIOUS_TEMPLATE: before[ANNOTATION_TEMPLATE],
                   **CONTROLLER_ANNOTATIONS}
    assert set(annotations) == {ANNOTATION_MODEL, ANNOTATION_TEMPLATE, ANNOTATION_PREVIOUS_TEMPLATE,
                                *CONTROLLER_ANNOTATIONS}
    assert sum(len(k) + len(v) for k, v in annotations.items()) <= 256 * 1024
    (init,) = after["spec"]["template"]["spec"]["initContainers"]
    (manifest,) = [e["value"] for e in init["env"] if e["name"] == WEIGHTS_ENV]
    assert len(f"{WEIGHTS_ENV}={manifest}".encode()) < 128 * 1024


@pytest.mark.integration  # kubectl kustomize renders the overlay
def test_own_racks_seed_port_is_admitted_by_the_control_planes_network_policy():
    """deploy/own-racks publishes the seed server on its host's port 8470, in the control-plane
    pod, whose NetworkPolicy admitted only Prometheus on the metrics port: on a CNI that enforces
    it the racks' fetches were dropped before the server saw them, and no rack could join. The
    overlay's policy admits the seed port from anywhere (a rack's host); the base's does not, and
    the metrics port stays Prometheus's alone."""
    from tests.test_deploy import rendered

    def policy(folder: str) -> dict:
        (found,) = [d for d in rendered(folder) if d["kind"] == "NetworkPolicy"
                    and d["metadata"]["name"] == "gpufleet-control-plane"]
        return found

    own_racks, base = policy("own-racks"), policy("kubernetes")
    assert policy_admits(own_racks, 8470, None, {})
    assert not policy_admits(base, 8470, None, {})
    assert not policy_admits(own_racks, 9464, None, {})
    assert policy_admits(own_racks, 9464, "monitoring", {"app.kubernetes.io/name": "prometheus"})
