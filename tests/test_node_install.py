"""The user data's install step (deploy/bootstrap/install-node.sh in the rendered document), run
as a machine runs it: the document's ``write_files`` written into a scratch root, its ``runcmd``
made into the shell script by the real cloud-init's own ``shellify`` (cc_runcmd), and that script
run by ``sh``.

What is not real, and why: there is no network here and no machine to change, so the programs
that would reach out or change the host are stubs on PATH that record their arguments (curl
serves files from a local mirror keyed by the exact URL; modprobe, sysctl, swapoff, systemctl,
dpkg, nvidia-smi, nvidia-ctk), the downloads are small stand-ins whose sha256 the test pins, and
the script writes under ``GPUFLEET_INSTALL_ROOT`` (empty on a machine) instead of ``/``. Its
checks, its sha256 verification (coreutils' sha256sum), tar, install and sed are the real ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from providers.cluster.bootstrap import (
    DEFAULT_NODE_INSTALL,
    INSTALL_SCRIPT_PATH,
    JOIN_CONFIG_PATH,
    NodeInstall,
    load_node_install,
    read_cloud_config,
    render_user_data,
)
from tests.test_bootstrap import params
from tests.tools import needs

pytestmark = [pytest.mark.integration, needs("cloud-init")]

K8S, CONTAINERD, RUNC, TOOLKIT = "v1.36.3", "2.4.2", "1.5.3", "1.20.2"
#: The upstream URLs the pins name, in the order the script fetches them.
URLS = {
    "containerd": f"https://github.com/containerd/containerd/releases/download/v{CONTAINERD}/"
                  f"containerd-{CONTAINERD}-linux-amd64.tar.gz",
    "runc": f"https://github.com/opencontainers/runc/releases/download/v{RUNC}/runc.amd64",
    "nvidia_container_toolkit": f"https://github.com/NVIDIA/nvidia-container-toolkit/releases/download/v{TOOLKIT}/"
                                f"nvidia-container-toolkit_{TOOLKIT}_deb_amd64.tar.gz",
    "kubeadm": f"https://dl.k8s.io/release/{K8S}/bin/linux/amd64/kubeadm",
    "kubelet": f"https://dl.k8s.io/release/{K8S}/bin/linux/amd64/kubelet",
}
TOOLS = ("sh", "cat", "mkdir", "rm", "mv", "install", "tar", "gzip", "sha256sum", "sed", "grep", "mktemp",
         "uname", "dirname", "find", "head", "wc", "chmod", "cp")
HOST_STUBS = ("modprobe", "sysctl", "swapoff", "systemctl")


def _script(log: Path, body: str = "") -> str:
    return f'#!/bin/sh\necho "$(basename "$0") $*" >> {log}\n{body}\n'


def _tarball(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class Sandbox:
    """A machine: a scratch root, the stubs above on PATH, a mirror of the publishers' files."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.root, self.stubs, self.tools = tmp, tmp / "root", tmp / "stubs", tmp / "tools"
        self.log, self.mirror = tmp / "calls.log", tmp / "mirror"
        for folder in (self.root, self.stubs, self.tools, self.mirror):
            folder.mkdir(parents=True)
        self.log.touch()
        for tool in TOOLS:
            (self.tools / tool).symlink_to(shutil.which(tool))
        curl = ('while [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift;; -*) ;; *) url=$1;; esac; shift; done\n'
                f'key=$(printf %s "$url" | sha256sum | cut -c1-64)\n'
                f'[ -f {self.mirror}/$key ] || exit 22\ncp {self.mirror}/$key "$out"')
        (self.tools / "cut").symlink_to(shutil.which("cut"))
        (self.tools / "basename").symlink_to(shutil.which("basename"))
        self.stub("curl", curl)
        for name in HOST_STUBS:
            self.stub(name)
        # dpkg "installs" the toolkit: its base package brings nvidia-ctk.
        self.stub("dpkg", 'case "$*" in *nvidia-container-toolkit-base_*) mkdir -p "$GPUFLEET_INSTALL_ROOT/usr/bin"; '
                          f'cp -p {self.stubs}/.nvidia-ctk "$GPUFLEET_INSTALL_ROOT/usr/bin/nvidia-ctk";; esac')
        nvidia_ctk = _script(self.log, 'for a; do case "$a" in --config=*) f=${a#--config=};; esac; done\n'
                                       'printf \'[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]'
                                       '\\n  BinaryName = "/usr/bin/nvidia-container-runtime"\\n\' >> "$f"')
        (self.stubs / ".nvidia-ctk").write_text(nvidia_ctk)
        (self.stubs / ".nvidia-ctk").chmod(0o755)
        self.sums: dict[str, str] = {}
        self.publish("containerd", _tarball({
            "bin/containerd": _script(self.log, '[ "$1 $2" = "config default" ] && printf \'version = 3\\n'
                                                '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]'
                                                '\\n  SystemdCgroup = false\\n\''),
            "bin/containerd-shim-runc-v2": _script(self.log), "bin/ctr": _script(self.log)}))
        self.publish("runc", _script(self.log).encode())
        debs = f"release-v{TOOLKIT}-stable/packages/ubuntu18.04/amd64"
        self.publish("nvidia_container_toolkit", _tarball({
            f"{debs}/{name}_{TOOLKIT}-1_amd64.deb": "deb" for name in (
                "libnvidia-container1", "libnvidia-container1-dbg", "libnvidia-container-tools",
                "nvidia-container-toolkit-base", "nvidia-container-toolkit")}))
        self.publish("kubeadm", _script(self.log, "echo fetched kubeadm").encode())
        self.publish("kubelet", _script(self.log).encode())

    def stub(self, name: str, body: str = "", where: Path | None = None) -> None:
        path = (where or self.stubs) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_script(self.log, body))
        path.chmod(0o755)

    def publish(self, part: str, data: bytes) -> None:
        (self.mirror / hashlib.sha256(URLS[part].encode()).hexdigest()).write_bytes(data)
        self.sums[part] = hashlib.sha256(data).hexdigest()

    def file(self, path: str, text: str) -> None:
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def kernel_ready(self) -> None:
        """What kubeadm's preflight wants from the kernel, already so."""
        (self.root / "sys/module/br_netfilter").mkdir(parents=True)
        self.file("/proc/sys/net/ipv4/ip_forward", "1\n")
        self.file("/proc/sys/net/bridge/bridge-nf-call-iptables", "1\n")
        self.file("/proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n")

    def prepared(self) -> None:
        """An image built per deploy/bootstrap/README.md: every part there and set up."""
        self.kernel_ready()
        for tool in ("kubeadm", "kubelet", "containerd", "runc", "nvidia-smi"):
            self.stub(tool, where=self.root / "usr/bin")
        shutil.copy2(self.stubs / ".nvidia-ctk", self.root / "usr/bin/nvidia-ctk")
        for unit in ("containerd.service", "kubelet.service"):  # as the packages install them
            self.file(f"/lib/systemd/system/{unit}", "[Service]\n")
        self.file("/etc/containerd/config.toml", 'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd.'
                                                 'runtimes.nvidia.options]\n  BinaryName = "/usr/bin/nvidia-container-runtime"\n')

    def pins(self, **sums: str) -> NodeInstall:
        shipped = load_node_install(DEFAULT_NODE_INSTALL)
        return shipped.model_copy(update={"sha256": {"amd64": shipped.sha256["amd64"].model_copy(update=sums)}})

    def boot(self, install: NodeInstall) -> subprocess.CompletedProcess:
        """The rendered document, as cloud-init runs it: write_files, then the runcmd script."""
        doc = read_cloud_config(render_user_data(params(), install=install))
        for entry in doc["write_files"]:
            self.file(entry["path"], entry["content"])
            (self.root / entry["path"].lstrip("/")).chmod(int(entry["permissions"], 8))
        shellified = subprocess.run(
            ["/usr/bin/python3", "-c", "import json, sys; from cloudinit import util; "
                                       "print(util.shellify(json.load(sys.stdin)), end='')"],
            input=json.dumps(doc["runcmd"]), capture_output=True, text=True, check=True).stdout
        runcmd = self.tmp / "runcmd"
        runcmd.write_text(shellified.replace("/etc/gpufleet/", f"{self.root}/etc/gpufleet/"))  # as a chroot would
        path = [self.stubs, self.root / "usr/local/sbin", self.root / "usr/local/bin", self.root / "usr/bin", self.tools]
        return subprocess.run(["sh", str(runcmd)], capture_output=True, text=True, timeout=60,
                              env={"PATH": os.pathsep.join(map(str, path)), "GPUFLEET_INSTALL_ROOT": str(self.root)})

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    def joined(self) -> bool:
        return f"kubeadm join --config {self.root}{JOIN_CONFIG_PATH}" in self.calls()


@pytest.fixture
def machine(tmp_path) -> Sandbox:
    return Sandbox(tmp_path)


def test_a_prepared_image_installs_nothing_and_joins(machine: Sandbox) -> None:
    machine.prepared()
    config = (machine.root / "etc/containerd/config.toml").read_text()
    booted = machine.boot(machine.pins())  # no sum pinned: nothing is needed
    assert "nothing to install" in booted.stdout, booted.stdout + booted.stderr
    assert machine.calls() == [f"kubeadm join --config {machine.root}{JOIN_CONFIG_PATH}"], \
        "no download, no kernel or service change: only the join"
    assert (machine.root / "etc/containerd/config.toml").read_text() == config
    assert not (machine.root / JOIN_CONFIG_PATH.lstrip("/")).exists(), "the token file goes after the join"


def test_a_stock_image_gets_each_part_from_its_pinned_url_checked_then_joins(machine: Sandbox) -> None:
    machine.stub("nvidia-smi", where=machine.root / "usr/bin")  # the driver: the image's, always
    machine.file("/proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n/swap.img\tfile\t4G\t0\t-2\n")
    machine.file("/proc/sys/net/ipv4/ip_forward", "0\n")
    machine.file("/etc/fstab", "UUID=1 / ext4 defaults 0 1\n/swap.img none swap sw 0 0\n")
    booted = machine.boot(machine.pins(**machine.sums))
    assert booted.returncode == 0 and machine.joined(), booted.stdout + booted.stderr
    calls = machine.calls()
    assert [c.split()[-1] for c in calls if c.startswith("curl ")] == list(URLS.values())
    for expected in ("modprobe overlay", "modprobe br_netfilter", "swapoff -a", "systemctl daemon-reload",
                     "systemctl enable containerd", "systemctl restart containerd", "systemctl enable kubelet"):
        assert expected in calls, (expected, calls)
    assert f"sysctl -q -p {machine.root}/etc/sysctl.d/90-gpufleet-kubernetes.conf" in calls
    assert "net.bridge.bridge-nf-call-iptables = 1" in (machine.root / "etc/sysctl.d/90-gpufleet-kubernetes.conf").read_text()
    assert "# off for the kubelet: /swap.img none swap" in (machine.root / "etc/fstab").read_text()
    [dpkg] = [c for c in calls if c.startswith("dpkg ")]
    assert dpkg.startswith("dpkg -i") and "-dbg_" not in dpkg and dpkg.count(".deb") == 4
    config = (machine.root / "etc/containerd/config.toml").read_text()
    assert "SystemdCgroup = true" in config and "nvidia-container-runtime" in config
    assert "nvidia-ctk runtime configure --runtime=containerd --set-as-default " \
           f"--config={machine.root}/etc/containerd/config.toml" in calls
    for path in ("usr/local/bin/containerd", "usr/local/bin/kubeadm", "usr/local/bin/kubelet", "usr/local/sbin/runc"):
        assert os.access(machine.root / path, os.X_OK), path
    dropin = (machine.root / "etc/systemd/system/kubelet.service.d/10-kubeadm.conf").read_text()
    assert "ExecStart=/usr/local/bin/kubelet $KUBELET_KUBECONFIG_ARGS" in dropin
    assert "ExecStart=/usr/local/bin/containerd" in (machine.root / "etc/systemd/system/containerd.service").read_text()
    assert calls[-1].startswith("kubeadm join") and "fetched kubeadm" in booted.stdout, "the join runs last, " \
        "with the kubeadm just installed"


def test_a_download_without_its_pinned_sha256_stops_the_join_before_kubeadm(machine: Sandbox) -> None:
    machine.prepared()
    (machine.root / "usr/bin/containerd").unlink()
    (machine.root / "etc/containerd/config.toml").unlink()
    booted = machine.boot(machine.pins(containerd="0" * 64))
    assert f"{URLS['containerd']} does not have the pinned sha256 {'0' * 64}: not joining" in booted.stderr
    assert not machine.joined() and not any(c.startswith("kubeadm") for c in machine.calls())
    assert not (machine.root / "usr/local/bin/containerd").exists(), "nothing of it unpacked"
    assert not (machine.root / JOIN_CONFIG_PATH.lstrip("/")).exists(), "the token file goes all the same"


def test_a_missing_part_with_no_sha256_pinned_stops_the_join_naming_it(machine: Sandbox) -> None:
    machine.prepared()
    (machine.root / "usr/bin/kubelet").unlink()
    booted = machine.boot(load_node_install(DEFAULT_NODE_INSTALL))  # as shipped: no sums
    assert "kubelet is not on this image and node-install.yaml pins no sha256 for it (amd64): not joining" \
        in booted.stderr
    assert not machine.joined() and not any(c.startswith("curl") for c in machine.calls())


def test_an_image_without_the_nvidia_driver_does_not_join(machine: Sandbox) -> None:
    machine.prepared()
    (machine.root / "usr/bin/nvidia-smi").unlink()
    booted = machine.boot(machine.pins(**machine.sums))
    assert "no NVIDIA driver (nvidia-smi) on this image: not joining" in booted.stderr
    assert not machine.joined()


def test_dockers_containerd_gets_its_cri_plugin_and_the_nvidia_runtime(machine: Sandbox) -> None:
    machine.prepared()
    machine.file("/etc/containerd/config.toml", 'disabled_plugins = ["cri"]\n')  # containerd.io's package
    (machine.root / "usr/bin/containerd").write_text(
        _script(machine.log, '[ "$1 $2" = "config default" ] && printf \'version = 3\\n  SystemdCgroup = false\\n\''))
    booted = machine.boot(machine.pins())
    assert booted.returncode == 0 and machine.joined(), booted.stdout + booted.stderr
    config = (machine.root / "etc/containerd/config.toml").read_text()
    assert "disabled_plugins" not in config and "SystemdCgroup = true" in config and "nvidia-container-runtime" in config
    calls = machine.calls()
    assert "systemctl restart containerd" in calls and not any(c.startswith("curl") for c in calls)
    assert calls.index("systemctl restart containerd") < calls.index(f"kubeadm join --config {machine.root}{JOIN_CONFIG_PATH}")


def test_the_shipped_script_is_the_one_in_the_document() -> None:
    doc = read_cloud_config(render_user_data(params()))
    [entry] = [e for e in doc["write_files"] if e["path"] == INSTALL_SCRIPT_PATH]
    assert entry["permissions"] == "0700"
    shipped = [line for line in (DEFAULT_NODE_INSTALL.parent / "install-node.sh").read_text().splitlines()
               if not line.lstrip().startswith("#")]
    assert [line for line in entry["content"].splitlines() if not line.lstrip().startswith("#")][14:] == shipped


def test_parts_placed_by_hand_get_their_units_and_nothing_is_downloaded(machine: Sandbox) -> None:
    """The image recipe's path: binaries in place, no packages, so no units yet."""
    machine.prepared()
    for unit in ("containerd.service", "kubelet.service"):
        (machine.root / "lib/systemd/system" / unit).unlink()
    booted = machine.boot(machine.pins())
    assert booted.returncode == 0 and machine.joined(), booted.stdout + booted.stderr
    assert "ExecStart=/usr/local/bin/containerd" in (machine.root / "etc/systemd/system/containerd.service").read_text()
    assert (machine.root / "etc/systemd/system/kubelet.service.d/10-kubeadm.conf").exists()
    calls = machine.calls()
    assert not any(c.startswith("curl") for c in calls)
    assert {"systemctl daemon-reload", "systemctl enable containerd", "systemctl enable kubelet"} <= set(calls)
    machine.log.write_text("")
    again = machine.boot(machine.pins())
    assert "nothing to install" in again.stdout and machine.calls() == [
        f"kubeadm join --config {machine.root}{JOIN_CONFIG_PATH}"], "a second run: a prepared image"
