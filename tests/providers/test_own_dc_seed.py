"""The own-rack NoCloud seed (issue 24): the adapter writes it before the machine boots,
the seed server (providers/own_dc_seed.py) gives it once, and only to that machine's
provisioning address. Against sushy-tools' Redfish emulator (the adapter) and real HTTP
from distinct loopback source addresses (the machines)."""

from __future__ import annotations

import logging

import httpx
import pytest

from providers.cluster.bootstrap import JoinParams, read_join_configuration, render_user_data
from providers.own_dc_seed import SeedServer
from tests.providers.harness_own_dc import SYSTEMS, OwnDcHarness
from tests.tools import needs

TOKEN = "abcdef.0123456789abcdef"
IPXE = "#!ipxe\nkernel http://boot/vmlinuz ip=dhcp ds=nocloud-net;s=$seed_url\ninitrd http://boot/initrd\nboot\n"


def fetch(server: SeedServer, source: str, path: str) -> httpx.Response:
    """A GET as the machine at ``source`` makes it (its own source address)."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=5) as client:
        return client.get(f"http://127.0.0.1:{server.port}{path}")


@pytest.fixture
def seeded(own_dc_harness: OwnDcHarness, tmp_path):
    harness = own_dc_harness
    harness.provider.options["seed_dir"] = str(tmp_path / "seeds")
    # Each rack machine's static DHCP lease on the provisioning network.
    addresses = {s["name"]: f"127.0.0.{i + 2}" for i, s in enumerate(SYSTEMS)}
    server = SeedServer(tmp_path / "seeds", addresses, "http://seeds.rack.example:8470", IPXE).start()
    yield harness, server, addresses
    server.stop()


def user_data_for(harness: OwnDcHarness, token: str = TOKEN) -> str:
    name = harness.spec.name
    return render_user_data(JoinParams(api_server="10.0.0.1:6443", ca_data="Y2E=", token=token,
                                       node_name=name, provider_id=f"gpufleet://own-dc/dc-fra/{name}", site="dc-fra"))


def test_the_seed_goes_once_and_only_to_its_machine(seeded, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    harness, server, addresses = seeded
    user_data = user_data_for(harness)
    machine = harness.provider.create_machine(harness.spec, "seed-once", user_data=user_data)
    mine, neighbour = addresses[machine.id], next(a for m, a in addresses.items() if m != machine.id)
    folder = server.seed_dir / machine.id
    assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()} == {
        "user-data": 0o600, "meta-data": 0o600, "nonce": 0o600}
    nonce = (folder / "nonce").read_text()
    seed = f"/seed/{nonce}"

    # Another machine of the rack, even holding the URL, and an address that is no machine's.
    assert fetch(server, neighbour, "/ipxe").status_code == 404
    for source in (neighbour, "127.0.0.99"):
        stolen = fetch(server, source, f"{seed}/user-data")
        assert (stolen.status_code, stolen.text) == (404, "")
    assert (folder / "user-data").exists(), "a refused request takes nothing"
    # Its own address with a wrong URL.
    assert fetch(server, mine, "/seed/guessed/user-data").status_code == 404

    # The machine boots: iPXE script, then cloud-init's NoCloud fetches.
    script = fetch(server, mine, "/ipxe")
    assert script.status_code == 200
    assert f"ds=nocloud-net;s=http://seeds.rack.example:8470{seed}/" in script.text
    meta = fetch(server, mine, f"{seed}/meta-data")
    assert meta.status_code == 200 and f"local-hostname: {harness.spec.name}" in meta.text
    got = fetch(server, mine, f"{seed}/user-data")
    assert got.status_code == 200 and got.text == user_data
    assert read_join_configuration(got.text)["nodeRegistration"]["name"] == harness.spec.name

    # Once: a second fetch (the machine again, or anyone) finds nothing, and no boot script either.
    again = fetch(server, mine, f"{seed}/user-data")
    assert (again.status_code, again.text) == (404, "")
    assert fetch(server, mine, "/ipxe").status_code == 404
    assert not (folder / "user-data").exists() and not (folder / "nonce").exists()
    # (The test's own HTTP client logs its URLs; what the server and the adapter log must not.)
    ours = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(("httpx", "httpcore")))
    assert "seed of machine" in ours
    assert TOKEN.split(".")[1] not in ours and nonce not in ours, "the log names neither"

    # A reinstall hands the machine a fresh seed at a fresh URL; the old one stays dead.
    fresh = user_data_for(harness, token="ghijkl.0123456789abcdef")
    harness.provider.reinstall_machine(machine.id, user_data=fresh)
    new_nonce = (folder / "nonce").read_text()
    assert new_nonce != nonce
    assert fetch(server, mine, f"{seed}/user-data").status_code == 404
    assert fetch(server, mine, f"/seed/{new_nonce}/user-data").text == fresh

    # Back to the pool: nothing of the seed is left.
    harness.provider.reinstall_machine(machine.id, user_data=fresh)
    harness.provider.delete_machine(machine.id)
    assert [p.name for p in folder.iterdir()] == []


def _system_cloud_init() -> str | None:
    """The system python3 that has Debian's cloud-init package (`.ci/run` installs it)."""
    import shutil
    import subprocess

    python = shutil.which("python3", path="/usr/bin:/bin")
    if python and subprocess.run([python, "-c", "import cloudinit.sources.DataSourceNoCloud"],
                                 capture_output=True).returncode == 0:
        return python
    return None


def _boot_stages(cmdline: str) -> dict:
    """cloud-init's own local and network stages (the real package's ``main_init``) on a
    machine booted with ``cmdline``: tests/providers/cloud_init/nocloud_probe.py."""
    import json
    import subprocess
    from pathlib import Path

    done = subprocess.run([_system_cloud_init(), str(Path(__file__).parent / "cloud_init" / "nocloud_probe.py"),
                           cmdline], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _kernel_cmdline(script: str) -> str:
    import re

    kernel = next(line for line in script.splitlines() if line.startswith("kernel "))
    return "BOOT_IMAGE=/vmlinuz " + re.sub(r"^kernel \S+ ", "", kernel) + " quiet"


@needs("cloud-init")  # Debian's package: skipped without it, naming how to get it; failed in CI
def test_cloud_inits_own_boot_stages_apply_the_seed_from_the_shipped_boot_line(own_dc_harness, tmp_path) -> None:
    """The kernel command line the shipped iPXE template gives a rack machine, booted through the
    real cloud-init's (Debian 12's 22.4, the oldest supported) own stages: the local stage finds
    no seed it may use, the network stage's NoCloud datasource fetches the seed from gpufleet's
    seed server in network mode, and the stage goes on to take its user data as the boot's."""
    from pathlib import Path

    harness = own_dc_harness
    harness.provider.options["seed_dir"] = str(tmp_path / "seeds")
    template = (Path(__file__).resolve().parents[2] / "deploy" / "bootstrap" / "own-rack.ipxe").read_text()
    machine_address = "127.0.0.1"  # cloud-init's HTTP client cannot pick its source address
    server = SeedServer(tmp_path / "seeds", {SYSTEMS[0]["name"]: machine_address}, "", template)
    server.start()
    try:
        server.url = f"http://127.0.0.1:{server.port}"
        user_data = user_data_for(harness)
        machine = harness.provider.create_machine(harness.spec, "cloud-init", user_data=user_data)
        assert machine.id == SYSTEMS[0]["name"]
        stages = _boot_stages(_kernel_cmdline(fetch(server, machine_address, "/ipxe").text))
        assert stages["init-local"]["applies_user_data"] is False, stages
        assert stages["init"] == {"applies_user_data": True, "datasource": "DataSourceNoCloudNet",
                                  "dsmode": "net", "user_data": user_data}, stages
        assert fetch(server, machine_address, "/ipxe").status_code == 404, "the seed was taken, once"
    finally:
        server.stop()


@needs("cloud-init")  # Debian's package: skipped without it, naming how to get it; failed in CI
def test_cloud_init_before_23_2_fetches_a_ds_nocloud_http_seed_and_never_applies_it(own_dc_harness, tmp_path) -> None:
    """Why the boot line says ``nocloud-net``: with ``ds=nocloud;s=http://...`` cloud-init 22.4's
    network stage takes the seed (the seed server hands it out once) and then exits "in local
    mode", so the join document never runs."""
    harness = own_dc_harness
    harness.provider.options["seed_dir"] = str(tmp_path / "seeds")
    machine_address = "127.0.0.1"
    server = SeedServer(tmp_path / "seeds", {SYSTEMS[0]["name"]: machine_address}, "", IPXE.replace(
        "ds=nocloud-net;", "ds=nocloud;"))
    server.start()
    try:
        server.url = f"http://127.0.0.1:{server.port}"
        harness.provider.create_machine(harness.spec, "cloud-init-old-line", user_data=user_data_for(harness))
        stages = _boot_stages(_kernel_cmdline(fetch(server, machine_address, "/ipxe").text))
        assert stages["init"]["datasource"] == "DataSourceNoCloudNet" and stages["init"]["dsmode"] == "local", stages
        assert not any(stage["applies_user_data"] for stage in stages.values()), stages
        assert fetch(server, machine_address, "/ipxe").status_code == 404, "the seed is spent all the same"
    finally:
        server.stop()
