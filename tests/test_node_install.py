"""The user data's install step (deploy/bootstrap/install-node.sh in the rendered document), run
as a machine runs it: the shipped script, unchanged, at the absolute paths it names.

Each boot is a machine of its own: a private mount namespace (and network namespace: nothing
reaches out) whose root is an overlay of this host's ``/``, with the image the test describes
as a layer above it, and every write going to a scratch layer on a tmpfs. There the real
cloud-init's own code writes the document's ``write_files`` and makes its ``runcmd`` into the
instance's script (cc_write_files, util.shellify as cc_runcmd does), and that script runs in a
chroot of the overlay, as cloud-init's scripts_user runs it. What the boot wrote (the overlay's
upper layer) is copied out, so a test sees exactly which files the machine got, and this host
none of them.

What is not real, and why: there is no network here and no machine to change, so the programs
that would reach out or change the host are stubs first on PATH that record their arguments
(curl serves files from a local mirror keyed by the exact URL; modprobe, sysctl, swapoff,
systemctl, dpkg, nvidia-smi, nvidia-ctk), the downloads are small stand-ins whose sha256 the
test pins, and what the script reads from the kernel (``/proc/sys/net``, ``/proc/swaps``,
``/sys/module``) are the test's files mounted over the real ones (``/proc/sys`` and ``/sys``
are read-only besides). Its checks, its sha256 verification (coreutils' sha256sum), tar,
install, mkdir and sed are the real ones, at ``/``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from providers.cluster.bootstrap import (
    DEFAULT_NODE_INSTALL,
    DISCOVERY_CONFIG_PATH,
    INSTALL_SCRIPT_PATH,
    JOIN_CONFIG_PATH,
    NodeInstall,
    load_node_install,
    read_cloud_config,
    render_user_data,
)
from tests.test_bootstrap import params
from tests.tools import needs, skip_or_fail

pytestmark = [pytest.mark.integration, needs("cloud-init", "unshare")]

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
HOST_STUBS = ("modprobe", "sysctl", "swapoff", "systemctl")
JOIN = f"kubeadm join --config {JOIN_CONFIG_PATH}"
#: Where cloud-init's runcmd module writes the script (its instance's scripts folder).
RUNCMD = "/var/lib/cloud/instance/scripts/runcmd"
#: The PATH cloud-init's runcmd script gets on a machine (systemd's default for a service).
MACHINE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Where the test's side (stubs, mirror, calls log, kernel files) is mounted in the machine.
INSIDE = "/gpufleet-test"
#: What each test decides about the image: where this host has one of these, the machine does
#: not see it (a whiteout in the image layer), so a host with containerd or a kubelet tests the same.
HOST_HIDDEN = (
    *(f"{folder}/{program}" for folder in MACHINE_PATH.split(":")
      for program in ("kubeadm", "kubelet", "containerd", "runc", "nvidia-smi", "nvidia-ctk")),
    *(f"{folder}/{unit}" for folder in ("/etc/systemd/system", "/usr/local/lib/systemd/system",
                                         "/lib/systemd/system", "/usr/lib/systemd/system")
      for unit in ("containerd.service", "kubelet.service")),
    "/etc/containerd/config.toml", "/var/lib/cloud",  # the last: a fresh instance's cloud-init state
)
#: What mount, chroot and unshare run with (they live in sbin).
ROOT_ENV = {"PATH": f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"}
#: The kernel's files the script reads → where the test keeps them (mounted over the real ones).
KERNEL = {"/proc/sys/net/": "kernel/net/", "/proc/swaps": "kernel/swaps", "/sys/module/": "kernel/module/"}

#: cloud-init's own code on the document, in the machine: write_files, then runcmd's script.
CLOUD_INIT = """
import sys
from cloudinit import util
from cloudinit.config import cc_write_files
config = util.load_yaml(sys.stdin.read())
cc_write_files.write_files("write_files", config["write_files"], "root:root")
util.write_file(sys.argv[1], util.shellify(config["runcmd"]), 0o700)
"""

#: One boot, run by ``unshare --mount --net``: $1 a folder for the machine's tmpfs, $2 the test's
#: side, $3 where what the boot wrote is copied to, then the image's layers, top first.
BOOT = r"""
set -eu
scratch=$1 side=$2 landed=$3
shift 3
mount -t tmpfs gpufleet-machine "$scratch"
# Every layer on the tmpfs: an overlay refuses a lower layer inside another (the test's inside /),
# and an upper one on an overlay (a container's /).
mkdir -p "$scratch/test$INSIDE" "$scratch/upper" "$scratch/work" "$scratch/root"
lower=$scratch/test
n=0
for layer; do
  n=$((n + 1))
  cp -a "$layer" "$scratch/$n"
  lower=$lower:$scratch/$n
done
root=$scratch/root
mount -t overlay gpufleet-machine -o "lowerdir=$lower:/,upperdir=$scratch/upper,workdir=$scratch/work" "$root"
mount -t proc proc "$root/proc"
mount --bind "$root/proc/sys" "$root/proc/sys"
mount -o remount,bind,ro "$root/proc/sys"
mount --bind "$side/kernel/net" "$root/proc/sys/net"
mount --bind "$side/kernel/swaps" "$root/proc/swaps"
mount -t sysfs -o ro sysfs "$root/sys"
mount --bind "$side/kernel/module" "$root/sys/module"
mount -t tmpfs -o mode=0755 dev "$root/dev"
for node in null zero full random urandom; do
  touch "$root/dev/$node"
  mount --bind "/dev/$node" "$root/dev/$node"
done
mount --bind "$side" "$root$INSIDE"
chroot "$root" /usr/bin/python3 -B -c "$CLOUD_INIT" "$RUNCMD" < "$side/user-data"
rc=0
chroot "$root" /usr/bin/env -i PATH="$INSIDE/stubs:$MACHINE_PATH" "$RUNCMD" > "$side/stdout" 2> "$side/stderr" || rc=$?
echo "$rc" > "$side/rc"
cp -a "$scratch/upper" "$landed"
"""


@functools.cache
def no_machine_here() -> str | None:
    """None where a boot can run (root, a private mount namespace, an overlay of /), else why not."""
    if os.geteuid() != 0:
        return "the install step's tests boot a machine in a mount namespace of its own: they need root"
    probe = ('mount -t tmpfs probe "$1" && mkdir "$1/upper" "$1/work" "$1/root" && '
             'mount -t overlay probe -o "lowerdir=/,upperdir=$1/upper,workdir=$1/work" "$1/root"')
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "--", "sh", "-c", probe,
                               "probe", scratch], capture_output=True, text=True, env=ROOT_ENV)
    if done.returncode:
        return f"no private mount namespace with an overlay of / here: {done.stderr.strip()}"
    return None


def _script(log: str, body: str = "") -> str:
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
    """A machine: an image over this host's ``/``, the stubs above first on PATH, a mirror of the
    publishers' files; each boot's writes land in a layer of their own."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.image, self.side = tmp, tmp / "image", tmp / "test"
        self.stubs, self.mirror, self.log = self.side / "stubs", self.side / "mirror", self.side / "calls.log"
        for folder in (self.image, self.stubs, self.mirror, self.side / "kernel/module"):
            folder.mkdir(parents=True)
        self.log.touch()
        # A fresh kernel: no forwarding, no br_netfilter, no swap.
        self.file("/proc/sys/net/ipv4/ip_forward", "0\n")
        self.file("/proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n")
        #: The machine's disk, top first: each boot's writes above the image.
        self.layers: list[Path] = [self.image]
        self.landed = tmp / "landed-none"  # no boot yet
        calls = f"{INSIDE}/calls.log"
        curl = ('while [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift;; -*) ;; *) url=$1;; esac; shift; done\n'
                f'key=$(printf %s "$url" | sha256sum | cut -c1-64)\n'
                f'[ -f {INSIDE}/mirror/$key ] || exit 22\ncp {INSIDE}/mirror/$key "$out"')
        self.stub("curl", curl)
        for name in HOST_STUBS:
            self.stub(name)
        # dpkg "installs" the toolkit: its base package brings nvidia-ctk.
        self.stub("dpkg", f'case "$*" in *nvidia-container-toolkit-base_*) cp -p {INSIDE}/stubs/.nvidia-ctk '
                          '/usr/bin/nvidia-ctk;; esac')
        nvidia_ctk = _script(calls, 'for a; do case "$a" in --config=*) f=${a#--config=};; esac; done\n'
                                    'printf \'[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]'
                                    '\\n  BinaryName = "/usr/bin/nvidia-container-runtime"\\n\' >> "$f"')
        (self.stubs / ".nvidia-ctk").write_text(nvidia_ctk)
        (self.stubs / ".nvidia-ctk").chmod(0o755)
        self.sums: dict[str, str] = {}
        self.publish("containerd", _tarball({
            "bin/containerd": _script(calls, '[ "$1 $2" = "config default" ] && printf \'version = 3\\n'
                                             '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]'
                                             '\\n  SystemdCgroup = false\\n\''),
            "bin/containerd-shim-runc-v2": _script(calls), "bin/ctr": _script(calls)}))
        self.publish("runc", _script(calls).encode())
        debs = f"release-v{TOOLKIT}-stable/packages/ubuntu18.04/amd64"
        self.publish("nvidia_container_toolkit", _tarball({
            f"{debs}/{name}_{TOOLKIT}-1_amd64.deb": "deb" for name in (
                "libnvidia-container1", "libnvidia-container1-dbg", "libnvidia-container-tools",
                "nvidia-container-toolkit-base", "nvidia-container-toolkit")}))
        self.publish("kubeadm", _script(calls, "echo fetched kubeadm").encode())
        self.publish("kubelet", _script(calls).encode())

    def stub(self, name: str, body: str = "", where: str | None = None) -> None:
        """A program that records its calls: on the test's PATH, or at ``where`` in the image."""
        path = self.stubs / name if where is None else self.at(f"{where}/{name}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_script(f"{INSIDE}/calls.log", body))
        path.chmod(0o755)

    def publish(self, part: str, data: bytes) -> None:
        (self.mirror / hashlib.sha256(URLS[part].encode()).hexdigest()).write_bytes(data)
        self.sums[part] = hashlib.sha256(data).hexdigest()

    def at(self, path: str) -> Path:
        """Where the test keeps the machine's ``path`` before it boots: the kernel's files the
        script reads, or the image (through this host's links, e.g. /lib → usr/lib, which the
        image must not shadow)."""
        for machine, ours in KERNEL.items():
            if path.startswith(machine):
                return self.side / (ours + path[len(machine):])
        folder, name = os.path.split(path)
        return self.image / os.path.realpath(folder).lstrip("/") / name

    def file(self, path: str, text: str) -> None:
        target = self.at(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def kernel_ready(self) -> None:
        """What kubeadm's preflight wants from the kernel, already so."""
        self.at("/sys/module/br_netfilter").mkdir(parents=True)
        self.file("/proc/sys/net/ipv4/ip_forward", "1\n")
        self.file("/proc/sys/net/bridge/bridge-nf-call-iptables", "1\n")

    def prepared(self) -> None:
        """An image built per deploy/bootstrap/README.md: every part there and set up."""
        self.kernel_ready()
        for tool in ("kubeadm", "kubelet", "containerd", "runc", "nvidia-smi"):
            self.stub(tool, where="/usr/bin")
        shutil.copy2(self.stubs / ".nvidia-ctk", self.at("/usr/bin/nvidia-ctk"))
        for unit in ("containerd.service", "kubelet.service"):  # as the packages install them
            self.file(f"/lib/systemd/system/{unit}", "[Service]\n")
        self.file("/etc/containerd/config.toml", 'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd.'
                                                 'runtimes.nvidia.options]\n  BinaryName = "/usr/bin/nvidia-container-runtime"\n')

    def pins(self, **sums: str) -> NodeInstall:
        shipped = load_node_install(DEFAULT_NODE_INSTALL)
        return shipped.model_copy(update={"sha256": {"amd64": shipped.sha256["amd64"].model_copy(update=sums)}})

    def _hide_what_this_host_has(self) -> None:
        for path in HOST_HIDDEN:
            hidden = self.at(path)
            if os.path.lexists(path) and not os.path.lexists(hidden):
                hidden.parent.mkdir(parents=True, exist_ok=True)
                os.mknod(hidden, stat.S_IFCHR, os.makedev(0, 0))

    def boot(self, install: NodeInstall) -> subprocess.CompletedProcess:
        """The rendered document, as a machine runs it (on the disk the earlier boots left)."""
        (self.side / "user-data").write_text(render_user_data(params(), install=install))
        self._hide_what_this_host_has()
        self.landed = self.tmp / f"landed-{len(self.layers)}"
        (self.tmp / "machine").mkdir(exist_ok=True)
        env = {**ROOT_ENV, "INSIDE": INSIDE, "CLOUD_INIT": CLOUD_INIT, "RUNCMD": RUNCMD, "MACHINE_PATH": MACHINE_PATH}
        done = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "--", "sh", "-c", BOOT,
                               "boot", str(self.tmp / "machine"), str(self.side), str(self.landed), *map(str, self.layers)],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, f"the machine did not start: {done.stderr}"
        self.layers.insert(0, self.landed)
        return subprocess.CompletedProcess([RUNCMD], int((self.side / "rc").read_text()),
                                           (self.side / "stdout").read_text(), (self.side / "stderr").read_text())

    def wrote(self, path: str) -> Path:
        """The file the last boot wrote at ``path`` (absent: it did not write one there)."""
        return self.landed / path.lstrip("/")

    def written(self) -> set[str]:
        """Every file the last boot wrote, or removed from the image (a whiteout)."""
        return {"/" + str(path.relative_to(self.landed)) for path in self.landed.rglob("*")
                if not path.is_dir() or path.is_symlink()}

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    def joined(self) -> bool:
        return JOIN in self.calls()


@pytest.fixture
def machine(tmp_path) -> Sandbox:
    reason = no_machine_here()
    if reason:
        skip_or_fail(reason)
    return Sandbox(tmp_path)


def test_a_prepared_image_installs_nothing_and_joins(machine: Sandbox) -> None:
    machine.prepared()
    booted = machine.boot(machine.pins())  # no sum pinned: nothing is needed
    assert "nothing to install" in booted.stdout, booted.stdout + booted.stderr
    assert machine.calls() == [JOIN], "no download, no kernel or service change: only the join"
    assert machine.written() == {INSTALL_SCRIPT_PATH, RUNCMD}, "nothing on the disk changed but cloud-init's " \
        "own files, and the token files went after the join"


def test_a_stock_image_gets_each_part_from_its_pinned_url_checked_then_joins(machine: Sandbox) -> None:
    machine.stub("nvidia-smi", where="/usr/bin")  # the driver: the image's, always
    machine.file("/proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n/swap.img\tfile\t4G\t0\t-2\n")
    machine.file("/etc/fstab", "UUID=1 / ext4 defaults 0 1\n/swap.img none swap sw 0 0\n")
    booted = machine.boot(machine.pins(**machine.sums))
    assert booted.returncode == 0 and machine.joined(), booted.stdout + booted.stderr
    calls = machine.calls()
    assert [c.split()[-1] for c in calls if c.startswith("curl ")] == list(URLS.values())
    for expected in ("modprobe overlay", "modprobe br_netfilter", "swapoff -a", "systemctl daemon-reload",
                     "systemctl enable containerd", "systemctl restart containerd", "systemctl enable kubelet",
                     "sysctl -q -p /etc/sysctl.d/90-gpufleet-kubernetes.conf",
                     "nvidia-ctk runtime configure --runtime=containerd --set-as-default "
                     "--config=/etc/containerd/config.toml"):
        assert expected in calls, (expected, calls)
    assert machine.written() == {
        INSTALL_SCRIPT_PATH, RUNCMD, "/etc/modules-load.d/gpufleet-kubernetes.conf",
        "/etc/sysctl.d/90-gpufleet-kubernetes.conf", "/etc/fstab", "/usr/local/bin/containerd",
        "/usr/local/bin/containerd-shim-runc-v2", "/usr/local/bin/ctr", "/usr/local/sbin/runc",
        "/etc/containerd/config.toml", "/usr/bin/nvidia-ctk", "/usr/local/bin/kubeadm", "/usr/local/bin/kubelet",
        "/etc/systemd/system/containerd.service", "/etc/systemd/system/kubelet.service",
        "/etc/systemd/system/kubelet.service.d/10-kubeadm.conf"}, "every part where systemd and PATH find it"
    assert machine.wrote("/etc/modules-load.d/gpufleet-kubernetes.conf").read_text() == "overlay\nbr_netfilter\n"
    assert "net.bridge.bridge-nf-call-iptables = 1" in machine.wrote("/etc/sysctl.d/90-gpufleet-kubernetes.conf").read_text()
    assert "# off for the kubelet: /swap.img none swap" in machine.wrote("/etc/fstab").read_text()
    [dpkg] = [c for c in calls if c.startswith("dpkg ")]
    assert dpkg.startswith("dpkg -i") and "-dbg_" not in dpkg and dpkg.count(".deb") == 4
    config = machine.wrote("/etc/containerd/config.toml").read_text()
    assert "SystemdCgroup = true" in config and "nvidia-container-runtime" in config
    for path in ("/usr/local/bin/containerd", "/usr/local/bin/kubeadm", "/usr/local/bin/kubelet", "/usr/local/sbin/runc"):
        assert os.access(machine.wrote(path), os.X_OK), path
    dropin = machine.wrote("/etc/systemd/system/kubelet.service.d/10-kubeadm.conf").read_text()
    assert "ExecStart=/usr/local/bin/kubelet $KUBELET_KUBECONFIG_ARGS" in dropin
    assert "ExecStart=/usr/local/bin/containerd" in machine.wrote("/etc/systemd/system/containerd.service").read_text()
    assert calls[-1].startswith("kubeadm join") and "fetched kubeadm" in booted.stdout, "the join runs last, " \
        "with the kubeadm just installed"


def test_a_download_without_its_pinned_sha256_stops_the_join_before_kubeadm(machine: Sandbox) -> None:
    machine.prepared()
    os.unlink(machine.at("/usr/bin/containerd"))
    os.unlink(machine.at("/etc/containerd/config.toml"))
    booted = machine.boot(machine.pins(containerd="0" * 64))
    assert f"{URLS['containerd']} does not have the pinned sha256 {'0' * 64}: not joining" in booted.stderr
    assert not machine.joined() and not any(c.startswith("kubeadm") for c in machine.calls())
    assert machine.written() == {INSTALL_SCRIPT_PATH, RUNCMD}, "nothing of it unpacked, and the token files " \
        "go all the same"


def test_a_missing_part_with_no_sha256_pinned_stops_the_join_naming_it(machine: Sandbox) -> None:
    machine.prepared()
    os.unlink(machine.at("/usr/bin/kubelet"))
    booted = machine.boot(load_node_install(DEFAULT_NODE_INSTALL))  # as shipped: no sums
    assert "kubelet is not on this image and node-install.yaml pins no sha256 for it (amd64): not joining" \
        in booted.stderr
    assert not machine.joined() and not any(c.startswith("curl") for c in machine.calls())
    assert {JOIN_CONFIG_PATH, DISCOVERY_CONFIG_PATH}.isdisjoint(machine.written())


def test_an_image_without_the_nvidia_driver_does_not_join(machine: Sandbox) -> None:
    machine.prepared()
    os.unlink(machine.at("/usr/bin/nvidia-smi"))
    booted = machine.boot(machine.pins(**machine.sums))
    assert "no NVIDIA driver (nvidia-smi) on this image: not joining" in booted.stderr
    assert not machine.joined()


def test_dockers_containerd_gets_its_cri_plugin_and_the_nvidia_runtime(machine: Sandbox) -> None:
    machine.prepared()
    machine.file("/etc/containerd/config.toml", 'disabled_plugins = ["cri"]\n')  # containerd.io's package
    machine.stub("containerd", '[ "$1 $2" = "config default" ] && printf \'version = 3\\n  SystemdCgroup = false\\n\'',
                 where="/usr/bin")
    booted = machine.boot(machine.pins())
    assert booted.returncode == 0 and machine.joined(), booted.stdout + booted.stderr
    config = machine.wrote("/etc/containerd/config.toml").read_text()
    assert "disabled_plugins" not in config and "SystemdCgroup = true" in config and "nvidia-container-runtime" in config
    calls = machine.calls()
    assert "systemctl restart containerd" in calls and not any(c.startswith("curl") for c in calls)
    assert calls.index("systemctl restart containerd") < calls.index(JOIN)


def test_the_shipped_script_is_the_one_in_the_document() -> None:
    doc = read_cloud_config(render_user_data(params()))
    [entry] = [e for e in doc["write_files"] if e["path"] == INSTALL_SCRIPT_PATH]
    assert entry["permissions"] == "0700"
    shipped = [line for line in (DEFAULT_NODE_INSTALL.parent / "install-node.sh").read_text().splitlines()
               if not line.lstrip().startswith("#")]
    assert [line for line in entry["content"].splitlines() if not line.lstrip().startswith("#")][14:] == shipped
    assert "GPUFLEET_" not in entry["content"], "what a machine runs has no switch for tests: they run it as shipped"


def test_parts_placed_by_hand_get_their_units_and_nothing_is_downloaded(machine: Sandbox) -> None:
    """The image recipe's path: binaries in place, no packages, so no units yet."""
    machine.prepared()
    for unit in ("containerd.service", "kubelet.service"):
        os.unlink(machine.at(f"/lib/systemd/system/{unit}"))
    booted = machine.boot(machine.pins())
    assert booted.returncode == 0 and machine.joined(), booted.stdout + booted.stderr
    assert "ExecStart=/usr/local/bin/containerd" in machine.wrote("/etc/systemd/system/containerd.service").read_text()
    assert machine.wrote("/etc/systemd/system/kubelet.service.d/10-kubeadm.conf").exists()
    calls = machine.calls()
    assert not any(c.startswith("curl") for c in calls)
    assert {"systemctl daemon-reload", "systemctl enable containerd", "systemctl enable kubelet"} <= set(calls)
    machine.log.write_text("")
    again = machine.boot(machine.pins())
    assert "nothing to install" in again.stdout and machine.calls() == [JOIN], "a second run: a prepared image"
    assert machine.written() == {INSTALL_SCRIPT_PATH, RUNCMD}
