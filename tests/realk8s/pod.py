"""A pod of the real tier: a Pod object the real API server made from a shipped Deployment, run
as a process the way the kubelet would run its one container, minus the image.

What is read back from the API server, never re-typed: the Pod (the Deployment's template as
the ReplicaSet controller created it, with the ``kube-api-access-*`` projected volume the
ServiceAccount admission plugin adds), the Secrets and ConfigMaps its volumes and ``env`` name,
the ``kubernetes`` Service's ClusterIP and port, and the Services the kubelet turns into the
container's service-link variables (``service_link_env``: every Service of the pod's namespace
unless the pod says ``enableServiceLinks: false``).  The service-account token is a real bound
token for the Pod (TokenRequest with ``boundObjectRef``, as the kubelet asks for it).

How it runs (needs root, as ``machine.py``):

* ``unshare --net``: a network namespace of its own, with ``lo`` carrying the ``kubernetes``
  Service's ClusterIP.  A forwarder (``nsforward.py``) there listens on that address and on the
  Temporal frontend's port and pipes them, through Unix sockets, to the host's API server and
  frontend; the container's own port is served back to a loopback port of the host.
* ``unshare --mount``: a mount namespace in which ``/etc`` and ``/run`` get an overlay (so the
  mount points can be made without touching the host), each volume is a folder bind-mounted on
  its ``mountPath`` (the service account's at ``/var/run/secrets/kubernetes.io/serviceaccount``,
  where the client's in-cluster loader reads it; a ``hostPath`` the folder, or file, the test's
  node keeps at that path), cluster DNS is an ``/etc/hosts`` entry
  (nothing here resolves ``*.svc``), and the root is then remounted read-only when the container
  asks for ``readOnlyRootFilesystem``.
* ``setpriv``: the pod's ``runAsUser``/``runAsGroup``/``fsGroup`` (uid 0 too, when the
  container asks for it), every capability dropped but those its ``capabilities.add`` names,
  ``no_new_privs`` where it sets ``allowPrivilegeEscalation: false`` (the kubelet's rule).
* cgroups: the container's ``resources`` as the kubelet sets them (cgroup v1: its memory limit
  as ``memory.limit_in_bytes``, its CPU request as ``cpu.shares``, a CPU limit as a CFS quota;
  cgroup v2: ``memory.max``, ``cpu.weight``, ``cpu.max``), the process and its children in them.

``ServiceFront`` is a Service in front of several such pods: each new connection goes to the
next ready one, a pod that stopped has no endpoint. ``PodNetwork`` is the pod network between such
pods: each one's own address (its ``status.podIP``) on an interface of its network namespace, all
on one bridge, so a pod dials another at its address and is seen from there at its own, as across
a cluster's pod network; a headless Service's name is then an ``/etc/hosts`` entry per address of
its EndpointSlices (``dns``), what the cluster DNS answers for it.
"""

from __future__ import annotations

import base64
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from tests.realk8s import image
from tests.realk8s.cluster import ClusterFailed, RealCluster
from tests.realk8s.nsforward import TcpToUnix
from tests.realk8s.relay import UnixRelay

REPO = Path(__file__).resolve().parents[2]
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _get(cluster: RealCluster, path: str) -> dict:
    status, answer = cluster.request("GET", path, admin=True)
    if status != 200:
        raise ClusterFailed(f"GET {path}: {status} {answer}")
    return answer


def created_pods(cluster: RealCluster, namespace: str, app: str, count: int, seconds: float = 60) -> list[dict]:
    """The ``count`` Pods the Deployment's ReplicaSet created (Pending or not: no kubelet runs
    them here), once it has made that many."""
    deadline = time.monotonic() + seconds
    while True:
        listed = _get(cluster, f"/api/v1/namespaces/{namespace}/pods?labelSelector="
                               + quote(f"app.kubernetes.io/name={app}"))
        pods = [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]
        if len(pods) >= count:
            return sorted(pods, key=lambda p: p["metadata"]["name"])
        if time.monotonic() > deadline:
            raise ClusterFailed(f"{len(pods)} pod(s) of {app} in {seconds:.0f} s, not {count}")
        time.sleep(0.3)


def daemon_pod(cluster: RealCluster, namespace: str, app: str, node_name: str, seconds: float = 60) -> dict:
    """The Pod the DaemonSet controller made for ``node_name``, once the scheduler bound it there
    (what the node's kubelet then starts; ``spec.nodeName`` is what its fieldRefs read)."""
    deadline = time.monotonic() + seconds
    while True:
        listed = _get(cluster, f"/api/v1/namespaces/{namespace}/pods?labelSelector="
                               + quote(f"app.kubernetes.io/name={app}"))
        pods = [p for p in listed["items"]
                if p["spec"].get("nodeName") == node_name and not p["metadata"].get("deletionTimestamp")]
        if pods:
            (pod,) = pods
            return pod
        if time.monotonic() > deadline:
            raise ClusterFailed(f"no pod of {app} bound to {node_name} in {seconds:.0f} s: "
                                f"{[(p['metadata']['name'], p['status']) for p in listed['items']]}")
        time.sleep(0.3)


def _secret(cluster: RealCluster, namespace: str, name: str) -> dict[str, bytes]:
    data = _get(cluster, f"/api/v1/namespaces/{namespace}/secrets/{name}").get("data") or {}
    return {key: base64.b64decode(value) for key, value in data.items()}


def _config_map(cluster: RealCluster, namespace: str, name: str) -> dict[str, bytes]:
    answer = _get(cluster, f"/api/v1/namespaces/{namespace}/configmaps/{name}")
    return {key: value.encode() for key, value in (answer.get("data") or {}).items()}


def _field(pod: dict, path: str) -> str:
    values = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
              "metadata.uid": pod["metadata"]["uid"], "spec.nodeName": pod["spec"].get("nodeName", ""),
              "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "")}
    return values[path]


def bound_token(cluster: RealCluster, pod: dict, seconds: int) -> str:
    """A service-account token bound to the Pod, as the kubelet requests it for the projected volume."""
    namespace, account = pod["metadata"]["namespace"], pod["spec"]["serviceAccountName"]
    status, answer = cluster.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"expirationSeconds": seconds, "boundObjectRef": {
             "apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}}},
        admin=True)
    if status != 201:
        raise ClusterFailed(f"token for {namespace}/{account}: {status} {answer}")
    return answer["status"]["token"]


def volume_files(cluster: RealCluster, pod: dict, volume: dict) -> dict[str, tuple[bytes, int]]:
    """What the kubelet writes into ``volume``: file → (content, mode)."""
    namespace = pod["metadata"]["namespace"]

    def picked(data: dict[str, bytes], source: dict, mode: int) -> dict[str, tuple[bytes, int]]:
        items = source.get("items") or [{"key": key, "path": key} for key in data]
        return {item["path"]: (data[item["key"]], item.get("mode", mode)) for item in items}

    if "secret" in volume:
        source = volume["secret"]
        return picked(_secret(cluster, namespace, source["secretName"]), source, source.get("defaultMode", 0o644))
    if "configMap" in volume:
        source = volume["configMap"]
        return picked(_config_map(cluster, namespace, source["name"]), source, source.get("defaultMode", 0o644))
    if "emptyDir" in volume:
        return {}
    if "projected" in volume:
        mode = volume["projected"].get("defaultMode", 0o644)
        files: dict[str, tuple[bytes, int]] = {}
        for source in volume["projected"]["sources"]:
            if "serviceAccountToken" in source:
                token = source["serviceAccountToken"]
                files[token["path"]] = (bound_token(cluster, pod, token.get("expirationSeconds", 3600)).encode(), mode)
            elif "configMap" in source:
                ref = source["configMap"]
                files.update(picked(_config_map(cluster, namespace, ref["name"]), ref, mode))
            elif "downwardAPI" in source:
                for item in source["downwardAPI"]["items"]:
                    files[item["path"]] = (_field(pod, item["fieldRef"]["fieldPath"]).encode(), item.get("mode", mode))
            else:
                raise ClusterFailed(f"projected source not handled here: {source}")
        return files
    raise ClusterFailed(f"volume kind not handled here: {volume}")


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


def service_link_env(cluster: RealCluster, pod: dict) -> dict[str, str]:
    """What the kubelet adds to every container's environment from Services (its
    ``getServiceEnvVarMap`` and ``envvars.FromServices``): the ``kubernetes`` Service's always, and
    every Service of the pod's namespace unless the pod says ``enableServiceLinks: false`` (the API
    server defaults it to true). Per Service with a cluster IP: ``<NAME>_SERVICE_HOST``,
    ``<NAME>_SERVICE_PORT`` (its first port) and ``_SERVICE_PORT_<PORT NAME>`` per named port, and
    Docker's link variables, ``<NAME>_PORT=tcp://<ip>:<first port>`` and
    ``<NAME>_PORT_<port>_<PROTO>[_PROTO|_PORT|_ADDR]`` per port; the name upper-cased, ``-`` as ``_``."""
    namespace = pod["metadata"]["namespace"]
    services = {"kubernetes": _get(cluster, "/api/v1/namespaces/default/services/kubernetes")}
    if pod["spec"].get("enableServiceLinks", True) is not False:
        for service in _get(cluster, f"/api/v1/namespaces/{namespace}/services")["items"]:
            services[service["metadata"]["name"]] = service
    env: dict[str, str] = {}
    for name, service in services.items():
        address, ports = service["spec"].get("clusterIP"), service["spec"].get("ports") or []
        if not address or address == "None" or not ports:  # headless, ExternalName
            continue
        prefix = _env_name(name)
        env[f"{prefix}_SERVICE_HOST"] = address
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{_env_name(port['name'])}"] = str(port["port"])
        for number, port in enumerate(ports):
            protocol = port.get("protocol") or "TCP"
            url = f"{protocol.lower()}://{f'[{address}]' if ':' in address else address}:{port['port']}"
            if number == 0:
                env[f"{prefix}_PORT"] = url
            each = f"{prefix}_PORT_{port['port']}_{protocol.upper()}"
            env.update({each: url, f"{each}_PROTO": protocol.lower(), f"{each}_PORT": str(port["port"]),
                        f"{each}_ADDR": address})
    return env


def container_env(cluster: RealCluster, pod: dict, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet makes it: its ``env``, each ``valueFrom``
    resolved against the real API server and ``$(VAR)`` expanded from the variables before it and
    the service links, then the service links it does not set itself (``service_link_env``)."""
    namespace = pod["metadata"]["namespace"]
    links = service_link_env(cluster, pod)
    env: dict[str, str] = {}
    for variable in container.get("env") or []:
        if "value" in variable:
            value = variable["value"]
        elif "fieldRef" in variable["valueFrom"]:
            value = _field(pod, variable["valueFrom"]["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in variable["valueFrom"]:
            ref = variable["valueFrom"]["secretKeyRef"]
            value = _secret(cluster, namespace, ref["name"])[ref["key"]].decode()
        else:
            ref = variable["valueFrom"]["configMapKeyRef"]
            value = _config_map(cluster, namespace, ref["name"])[ref["key"]].decode()
        for name, earlier in {**links, **env}.items():  # $(VAR), as the kubelet expands it
            value = value.replace(f"$({name})", earlier)
        env[variable["name"]] = value
    return {**links, **env}


CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_cgroup(controller: str) -> Path:
    """This process's cgroup for ``controller`` (``""``: the v2 hierarchy): the pod's go below it,
    so whatever bounds the test run bounds the pods too."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers.split(",") == [controller] or (not controller and controllers == ""):
            return Path(path.lstrip("/"))
    raise ClusterFailed(f"no {controller or 'v2'} cgroup in /proc/self/cgroup")


def _cgroups_for(pod: dict, container: dict) -> dict[Path, dict[str, str]]:
    """The cgroup folders the kubelet would put the container in, each with the files it writes
    there from the container's ``resources`` (requests.memory only schedules: nothing to write)."""
    from kubernetes.utils import parse_quantity

    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    cpu_request = requests.get("cpu") or limits.get("cpu")
    shares = max(2, int(parse_quantity(cpu_request) * 1024)) if cpu_request else 2
    quota = int(parse_quantity(limits["cpu"]) * 100_000) if "cpu" in limits else None
    memory = int(parse_quantity(limits["memory"])) if "memory" in limits else None
    name = f"gpufleet-realk8s-{pod['metadata']['uid']}"
    if (CGROUP_ROOT / "cgroup.controllers").exists():  # cgroup v2, one hierarchy
        parent = CGROUP_ROOT / _own_cgroup("")
        (parent / "cgroup.subtree_control").write_text("+memory +cpu")
        return {parent / name: {
            "memory.max": str(memory) if memory else "max",
            "cpu.weight": str(1 + ((shares - 2) * 9999) // 262142),
            "cpu.max": f"{quota} 100000" if quota else "max 100000"}}
    return {CGROUP_ROOT / "memory" / _own_cgroup("memory") / name:
            {"memory.limit_in_bytes": str(memory) if memory else "-1"},
            CGROUP_ROOT / "cpu" / _own_cgroup("cpu") / name:
            {"cpu.shares": str(shares), "cpu.cfs_quota_us": str(quota or -1)}}


def _make_cgroups(pod: dict, container: dict) -> list[Path]:
    made = []
    try:
        for folder, files in _cgroups_for(pod, container).items():
            folder.mkdir()
            made.append(folder)
            for name, value in files.items():
                (folder / name).write_text(value)
    except OSError as error:
        for folder in made:
            folder.rmdir()
        raise ClusterFailed(f"the pod's resources cannot be applied as cgroups here: {error}") from error
    return made


@dataclass
class RunningPod:
    process: subprocess.Popen
    log: Path
    #: containerPort → the host's loopback address that leads to it.
    ports: dict[int, str]
    relays: list = field(default_factory=list)
    sockets: Path | None = None

    #: The container's readinessProbe's port, when it is a ``tcpSocket`` probe.
    probe_port: int | None = None
    #: The cgroup folders holding the container's processes (its resources applied there).
    cgroups: list[Path] = field(default_factory=list)

    def cgroup_values(self) -> dict[str, str]:
        """What the container's cgroups hold now (each file the kubelet writes), for processes
        that are really in them (the container's process is)."""
        values = {}
        for folder in self.cgroups:
            if str(self.process.pid) not in (folder / "cgroup.procs").read_text().split():
                raise ClusterFailed(f"the container's process is not in {folder}")
            for name in ("memory.limit_in_bytes", "memory.max", "cpu.shares", "cpu.weight", "cpu.cfs_quota_us",
                         "cpu.max"):
                if (folder / name).exists():
                    values[name] = (folder / name).read_text().strip()
        return values

    def wait_ready(self, seconds: float = 60) -> None:
        """The readinessProbe, run inside the pod's network namespace (what the kubelet probes
        before the pod's Service sends it anything): a TCP connection to ``tcpSocket``'s port."""
        assert self.probe_port is not None, "no tcpSocket readinessProbe"
        probe = f"import socket; socket.create_connection(('127.0.0.1', {self.probe_port}), timeout=2).close()"
        deadline = time.monotonic() + seconds
        while subprocess.run(["nsenter", f"--target={self.process.pid}", "--net", sys.executable, "-c", probe],
                             capture_output=True, timeout=30).returncode != 0:
            if self.process.poll() is not None:
                raise ClusterFailed(f"the pod's container exited ({self.process.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterFailed(f"not ready in {seconds:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> int | None:
        """SIGTERM to the container's process group (the forwarder too), as the kubelet stops it."""
        code = self.process.poll()
        if code is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                code = self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever is left of the group (the forwarder)
        except ProcessLookupError:
            pass
        for relay in self.relays:
            relay.close()
        for folder in self.cgroups:
            deadline = time.monotonic() + 10
            while folder.exists():
                try:
                    folder.rmdir()
                except OSError:  # its last processes are still going
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        return code


def _module_file(interpreter: str, env: dict[str, str], module: str) -> str:
    """Where ``interpreter``, in the container's environment, imports ``module`` from."""
    done = subprocess.run([interpreter, "-c", "import importlib.util, sys; "
                           f"print(importlib.util.find_spec({module!r}).origin)"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ClusterFailed(f"the container's interpreter has no module {module}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def run_pod(cluster: RealCluster, pod: dict, root: Path, upstreams: dict[str, tuple[str, int]],
            host_paths: dict[str, Path] | None = None, stand_in_modules: dict[str, Path] | None = None,
            dns: dict[str, list[str]] | None = None, pod_network: "PodNetwork | None" = None) -> RunningPod:
    """Start the pod's one container as a process (see the module's docstring).

    ``upstreams``: ``host:port`` the container dials (the API server's Service is added here)
    → where that really is on this host's loopback.
    ``host_paths``: a ``hostPath`` volume's path on the pod's node → the folder that is that
    path on the test's node (bind-mounted itself, as the kubelet mounts the host's).
    ``stand_in_modules``: a Python module of the image → a test's stand-in for it, bind-mounted
    read-only over the module's file: only for what this machine cannot have (a GPU's NVML).
    ``dns``: a cluster DNS name → the addresses it answers (a headless Service's ready endpoints).
    ``pod_network``: the pod network the pod joins at its ``status.podIP``."""
    spec = pod["spec"]
    (container,) = spec["containers"]
    security = {**(spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    root.mkdir(parents=True, exist_ok=True)
    sockets = Path(tempfile.mkdtemp(prefix="gfp-"))  # a Unix socket's path is short
    os.chmod(sockets, 0o755)

    # The kubernetes Service, as the kubelet gives every pod KUBERNETES_SERVICE_HOST/PORT.
    service = _get(cluster, "/api/v1/namespaces/default/services/kubernetes")["spec"]
    api_host, api_port = service["clusterIP"], service["ports"][0]["port"]
    upstreams = {f"{api_host}:{api_port}": ("127.0.0.1", cluster.api_port), **upstreams}

    # Volumes: folders under root, bind-mounted on their mountPaths.
    volumes = {v["name"]: v for v in spec["volumes"]}
    group = spec.get("securityContext", {}).get("fsGroup")
    binds: list[tuple[Path, str, bool]] = []
    node_folders: list[tuple[str, Path, bool]] = []  # a hostPath's mountPath, the test node's folder
    for number, mount in enumerate(container["volumeMounts"]):
        host_path = volumes[mount["name"]].get("hostPath")
        if host_path is not None:
            folder = (host_paths or {}).get(host_path["path"])
            kind = host_path.get("type")
            if folder is None or (kind == "Directory" and not folder.is_dir()) or (
                    kind in ("File", "FileOrCreate") and not folder.is_file()):
                raise ClusterFailed(f"hostPath {host_path}: the test's node has no such {kind or 'path'} ({folder})")
            binds.append((folder, mount["mountPath"], bool(mount.get("readOnly"))))
            if folder.is_dir():  # a file holds no links to its own path
                node_folders.append((mount["mountPath"], folder, bool(mount.get("readOnly"))))
            continue
        folder = root / "volumes" / f"{number}-{mount['name']}"
        folder.mkdir(parents=True)
        for name, (data, mode) in volume_files(cluster, pod, volumes[mount["name"]]).items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(mode)
            if group is not None:
                os.chown(path, 0, group)
        if group is not None:  # the kubelet gives fsGroup the volume, group-writable for emptyDir
            os.chown(folder, 0, group)
            folder.chmod(0o2775 if "emptyDir" in volumes[mount["name"]] else 0o755)
        binds.append((folder, mount["mountPath"], bool(mount.get("readOnly"))))

    # The image's Python install, WORKDIR and ENV (tests/realk8s/image.py), not the dev venv's.
    installed = image.for_container(container["image"])
    # Its env and service links (KUBERNETES_SERVICE_HOST/PORT among them) over the image's ENV.
    env = {**installed.env, **container_env(cluster, pod, container)}
    env.update(PATH=f"{installed.python.parent}{os.pathsep}{os.environ['PATH']}", HOME="/")
    command = [part for part in container["command"]]
    for name, value in env.items():
        command = [part.replace(f"$({name})", value) for part in command]
    if command[0] == "python":
        command[0] = str(installed.python)

    # Network: the Service's ClusterIP on lo; names the manifest dials, in /etc/hosts.
    hosts = ["127.0.0.1 localhost"]
    network = ["ip link set lo up"]
    forward = [sys.executable, "-m", "tests.realk8s.nsforward"]
    relays: list = []
    for number, (dialled, target) in enumerate(upstreams.items()):
        host, _, port = dialled.rpartition(":")
        path = sockets / f"up{number}.sock"
        relays.append(UnixRelay(path, target))
        try:
            socket.inet_aton(host)
            address = host
            if not host.startswith("127."):
                network.append(f"ip addr add {host}/32 dev lo")
        except OSError:  # a cluster DNS name: loopback inside the pod's own namespace
            address = "127.0.0.1"
            hosts.append(f"{address} {host}")
        forward.append(f"--listen={address}:{port}={path}")
    for name, addresses in (dns or {}).items():
        hosts += [f"{address} {name}" for address in addresses]
    ports: dict[int, str] = {}
    for number, port in enumerate(p["containerPort"] for p in container.get("ports") or []):
        path = sockets / f"in{number}.sock"
        forward.append(f"--serve={path}=127.0.0.1:{port}")
        inbound = TcpToUnix(("127.0.0.1", 0), path)
        relays.append(inbound)
        ports[port] = f"127.0.0.1:{inbound.address[1]}"

    overlays = root / "overlay"
    mounts = []
    for top in ("/etc", "/run"):
        upper, work = overlays / top.strip("/") / "upper", overlays / top.strip("/") / "work"
        upper.mkdir(parents=True)
        work.mkdir(parents=True)
        mounts.append(f"mount -t overlay overlay -o lowerdir={top},upperdir={upper},workdir={work} {top}")
    mounts.append(f"cp /etc/hosts /etc/hosts.host && printf %s {shlex.quote(chr(10).join(hosts) + chr(10))}"
                  " > /etc/hosts")
    # Before the volumes: the stand-in may lie under a mountPath (a test's folder under /tmp).
    for module, stand_in in (stand_in_modules or {}).items():
        path = shlex.quote(_module_file(command[0], env, module))
        mounts += [f"mount --bind {shlex.quote(str(stand_in))} {path}", f"mount -o remount,bind,ro {path}"]
    # A mountPath above the volumes' own folders (an emptyDir on /tmp) goes last, or it hides them.
    # A mountPath inside another volume's (the Temporal client Secret inside the config's
    # ConfigMap) is mounted after it, on a mount point made in that volume's folder, as the
    # container runtime makes it: the outer volume is read-only inside the container.
    sources = [str(folder) for folder, _, _ in binds]
    binds.sort(key=lambda bind: (any(source.startswith(bind[1].rstrip("/") + "/") for source in sources),
                                 bind[1].rstrip("/").count("/")))
    for outer_folder, outer_path, _ in binds:
        for _, path, _ in binds:
            if path.startswith(outer_path.rstrip("/") + "/"):
                (outer_folder / path[len(outer_path.rstrip("/")) + 1:]).mkdir(parents=True, exist_ok=True)
    for folder, path, read_only in binds:
        if folder.is_file():  # a file's mount point is a file, as the container runtime makes it
            point = (f"mkdir -p {shlex.quote(str(Path(path).parent))} && "
                     f"{{ [ -e {shlex.quote(path)} ] || touch {shlex.quote(path)}; }}")
        else:
            point = f"mkdir -p {shlex.quote(path)}"
        mounts.append(f"{point} && mount --bind {shlex.quote(str(folder))} {shlex.quote(path)}")
        if read_only:
            mounts.append(f"mount -o remount,bind,ro {shlex.quote(path)}")
    # The test's node keeps its filesystem in a folder, so the links its kubelet writes there name
    # their files by that folder's path (kubelet-client-current.pem → <folder>/kubelet-client-<date>.pem)
    # where a real node's name the hostPath's own: that path leads to the mounted volume too.
    # Made last, from the mountPath: the folder may lie under another volume's (an emptyDir on /tmp).
    for path, folder, read_only in node_folders:
        mounts += [f"mkdir -p {shlex.quote(str(folder))}",
                   f"mount --bind {shlex.quote(path)} {shlex.quote(str(folder))}"]
        if read_only:
            mounts.append(f"mount -o remount,bind,ro {shlex.quote(str(folder))}")
    if security.get("readOnlyRootFilesystem"):
        mounts.append("mount -o remount,bind,ro /")
    user = []
    if security.get("runAsUser") is not None:
        # As the container runtime grants them: the bounding set is what a process of the
        # container can ever hold (for uid 0, what it holds after exec), nothing inheritable.
        added = "".join(f",+{name.lower().removeprefix('cap_')}"
                        for name in (security.get("capabilities") or {}).get("add") or [])
        user = ["setpriv", f"--reuid={security['runAsUser']}", f"--regid={security.get('runAsGroup', 0)}",
                f"--groups={group}" if group is not None else "--clear-groups", "--inh-caps=-all",
                f"--bounding-set=-all{added}"]
        if security.get("allowPrivilegeEscalation") is False:
            user.append("--no-new-privs")
    environment = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
    inner = "set -e; " + "; ".join(mounts) + f"; cd {shlex.quote(str(installed.workdir))}; exec " + shlex.join(
        [*user, *environment, *command])
    outer = ("set -e; " + "; ".join(network) + f"; cd {shlex.quote(str(REPO))}; {shlex.join(forward)} & "
             + shlex.join(["exec", "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", inner]))
    cgroups = _make_cgroups(pod, container)
    # Into the container's cgroups before anything else runs: every process after inherits them.
    outer = "".join(f"echo $$ > {shlex.quote(str(folder / 'cgroup.procs'))}; " for folder in cgroups) + outer
    log = root / "container.log"
    process = subprocess.Popen(["unshare", "--net", "--", "sh", "-c", outer], stdout=log.open("ab"),
                               stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    if pod_network is not None:
        pod_network.attach(process.pid, pod["status"]["podIP"])
    probe = (container.get("readinessProbe") or {}).get("tcpSocket", {}).get("port")
    named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
    return RunningPod(process, log, ports, relays, sockets, named.get(probe, probe), cgroups)


class PodNetwork:
    """One bridge in the host's network namespace (no address of the host's on it), and per pod a
    veth pair: one end on the bridge, the other the pod's ``eth0`` carrying its pod address, as a
    CNI plugin wires a pod (bridge plugin). Traffic between pods stays on the bridge; the pods'
    ends go with their network namespaces, the bridge with ``close``."""

    PREFIX = 24

    def __init__(self) -> None:
        self.bridge = f"gfpn{uuid.uuid4().hex[:8]}"
        self._pods = 0
        subprocess.run(["ip", "link", "add", "name", self.bridge, "type", "bridge"], check=True, capture_output=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True, capture_output=True)

    def attach(self, pid: int, address: str, seconds: float = 10) -> None:
        """``pid``'s network namespace (once it has its own) gets ``eth0`` at ``address``."""
        host = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + seconds
        while os.readlink(f"/proc/{pid}/ns/net") == host:  # unshare(2) not yet done
            if time.monotonic() > deadline:
                raise ClusterFailed(f"process {pid} has no network namespace of its own")
            time.sleep(0.01)
        outer, inner = f"{self.bridge}h{self._pods}", f"{self.bridge}p{self._pods}"
        self._pods += 1
        for command in (["ip", "link", "add", outer, "type", "veth", "peer", "name", inner],
                        ["ip", "link", "set", outer, "master", self.bridge, "up"],
                        ["ip", "link", "set", inner, "netns", str(pid)],
                        ["nsenter", f"--net=/proc/{pid}/ns/net", "sh", "-c",
                         f"ip link set {inner} name eth0 && ip addr add {address}/{self.PREFIX} dev eth0 "
                         "&& ip link set eth0 up"]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise ClusterFailed(f"{' '.join(command)}: {done.stderr.strip()}")

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class ServiceFront:
    """A Service's virtual address in front of pods: each connection goes to the next backend in
    turn that takes it (a stopped pod's port refuses, as a pod without an endpoint gets nothing)."""

    def __init__(self, backends: list[str]) -> None:
        self.backends = [(host, int(port)) for host, _, port in (b.rpartition(":") for b in backends)]
        self.chosen: list[tuple[str, int]] = []
        self._next = 0
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="service front").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            outbound = None
            for _ in range(len(self.backends)):
                backend = self.backends[self._next % len(self.backends)]
                self._next += 1
                try:
                    outbound = socket.create_connection(backend, timeout=5)
                    outbound.settimeout(None)
                    self.chosen.append(backend)
                    break
                except OSError:
                    continue
            if outbound is None:
                inbound.close()
                continue
            for source, sink in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=UnixRelay._pipe, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
