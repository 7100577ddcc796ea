"""The repair ladder's driver reinstall on the node (``reinstall_via: agent``) as shipped: the node
agent's own code (``NvmlBackend.reinstall_driver``) with the environment the node agent's
DaemonSet gives it, against a stand-in host.

The command is the one deploy/driver-reinstall sets (read from the rendered kustomization, as
kubectl applies it). The stand-in host is a PID namespace whose init has a mount namespace of its
own holding the node image's script at ``DRIVER_REINSTALL_SCRIPT``; the agent runs in a mount
namespace of its own under it, where no such script is, as in its container (with hostPID the
host's init is the pod's PID 1). What the agent answers, and the namespace the script ran in, are
what the test reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleet.repair_policy import DRIVER_REINSTALL_SCRIPT
from tests.test_deploy import kustomization_with, manifest_values, rendered, rendered_at, workloads
from tests.tools import needs, skip_or_fail

pytestmark = [pytest.mark.integration, needs("kubectl", "unshare", "nsenter")]

ROOT = Path(__file__).resolve().parents[1]

#: $1: the test's folder. PID 1 of a PID namespace of its own (the host's init), in a mount
#: namespace of its own: the node image's script where the image keeps it (a tmpfs over its
#: folder, in this namespace only), then the agent, in a mount namespace of its own without it
#: (its container), as a child; the host stays up until the agent is done.
HOST = r"""
set -e
folder=$(dirname "$2")
mount -t tmpfs host-image "$folder"
[ ! -e "$1/script" ] || install -m 0755 "$1/script" "$2"
shift 2
unshare --mount --propagation private -- sh -c "mount -t tmpfs container-image $folder && exec \"\$@\"" agent "$@"
"""

#: The agent's code as the node agent calls it (activities/node_agent.py): its answer, or why not.
AGENT = r"""
import json, os, types
from providers.gpu import NvmlBackend

# No GPU here: NVML only starts, and stops for the script.
backend = NvmlBackend(nvml=types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                                 NVMLError=Exception))
answer = {"mnt": os.readlink("/proc/self/ns/mnt"), "sees_script": os.path.exists(os.environ["SCRIPT"])}
try:
    answer["said"] = backend.reinstall_driver()
except RuntimeError as error:
    answer["error"] = str(error)
print(json.dumps(answer))
"""


def no_host_here() -> str | None:
    if os.geteuid() != 0:
        return "a stand-in host is a PID and mount namespace of its own: needs root"
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--propagation", "private", "--mount-proc",
                           "--", "true"], capture_output=True, text=True)
    return f"no PID and mount namespace here: {done.stderr.strip()}" if done.returncode else None


def shipped_agent_env(tmp_path: Path, components: list[str]) -> dict[str, str]:
    """The node agent's env values as the base with these components renders them."""
    docs = rendered_at(kustomization_with(tmp_path, ["kubernetes"], components)) if components else rendered()
    (agent,) = workloads(docs)["gpufleet-node-agent"]["spec"]["template"]["spec"]["containers"]
    return manifest_values(agent)


def run_on_a_host(tmp_path: Path, env: dict[str, str], script: str | None) -> dict:
    """The agent's reinstall on a stand-in host whose image has ``script`` (None: none)."""
    reason = no_host_here()
    if reason:
        skip_or_fail(reason)
    folder = Path(tempfile.mkdtemp(prefix="host-", dir=tmp_path))
    if script is not None:
        (folder / "script").write_text(script)
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--propagation", "private", "--mount-proc", "--",
         "sh", "-c", HOST, "host", str(folder), DRIVER_REINSTALL_SCRIPT, sys.executable, "-c", AGENT],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "SCRIPT": DRIVER_REINSTALL_SCRIPT, **env},
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


#: The node image's script, a stand-in: says where it ran (its mount namespace and the host
#: init's), and what a real one prints.
SCRIPT = """#!/bin/sh
readlink /proc/self/ns/mnt > {out}/ran-in
readlink /proc/1/ns/mnt > {out}/init-mnt
echo "nvidia-driver-570-server reinstalled"
"""


def test_the_shipped_command_runs_the_node_images_script_as_the_host(tmp_path: Path) -> None:
    """With the component's environment the agent runs the script of the host's image, in the
    host's mount namespace, though its own has none; its answer is the rung's."""
    env = shipped_agent_env(tmp_path, ["driver-reinstall"])
    answer = run_on_a_host(tmp_path, env, SCRIPT.format(out=tmp_path))
    assert answer.get("said") == "driver reinstalled", answer
    assert answer["sees_script"] is False, "the agent's own mount namespace has no such script"
    ran_in = (tmp_path / "ran-in").read_text().strip()
    assert ran_in == (tmp_path / "init-mnt").read_text().strip(), "in the host's (PID 1's) mount namespace"
    assert ran_in != answer["mnt"]


def test_a_failed_or_missing_script_fails_the_rung_saying_why(tmp_path: Path) -> None:
    """The end of what the script printed is the rung's reason; an image without the script
    fails it too (not an error the activity would retry)."""
    env = shipped_agent_env(tmp_path, ["driver-reinstall"])
    failing = "#!/bin/sh\necho 'E: Unable to locate package nvidia-driver-570-server' >&2\nexit 100\n"
    answer = run_on_a_host(tmp_path, env, failing)
    assert answer.get("error") == "driver reinstall failed: E: Unable to locate package nvidia-driver-570-server"
    answer = run_on_a_host(tmp_path, env, None)
    assert answer.get("error", "").startswith("driver reinstall failed: nsenter: failed to execute "
                                              f"{DRIVER_REINSTALL_SCRIPT}"), answer


def test_without_the_component_the_agent_runs_nothing_and_says_what_allows_it(tmp_path: Path) -> None:
    """The base's DaemonSet sets no command: the rung fails at once, naming what allows it."""
    env = shipped_agent_env(tmp_path, [])
    assert "GPUFLEET_DRIVER_REINSTALL_CMD" not in env
    answer = run_on_a_host(tmp_path, env, SCRIPT.format(out=tmp_path))
    assert "no driver reinstall command configured" in answer.get("error", ""), answer
    assert "deploy/driver-reinstall" in answer["error"] and "nodeAgent.driverReinstall=true" in answer["error"]
    assert not (tmp_path / "ran-in").exists()


def test_a_command_that_is_not_there_fails_the_rung(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An image without the program the command names (no nsenter) fails the rung, saying so (a
    DriverReinstallFailed, not retried): the OSError went up as an error the activity retried."""
    import types

    from providers.gpu import NvmlBackend

    monkeypatch.setenv("GPUFLEET_DRIVER_REINSTALL_CMD", f"{tmp_path / 'nsenter'} --target 1")
    with pytest.raises(RuntimeError, match="^driver reinstall failed: .*No such file or directory"):
        NvmlBackend(nvml=types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                               NVMLError=Exception)).reinstall_driver()
