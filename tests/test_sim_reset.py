"""A resettable sim (issue 36): every `gpufleet sim` knob prints the exact command that undoes
it, and `gpufleet sim reset` puts every knob of every site and account back to the config's
defaults, saying what it reset. The tour broke later steps because its knobs stayed set.

The commands run as an operator runs them, on the test fleet's own sim.db."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from fleet.config import load_config
from fleet.models import MachineSpec
from sim.provider import SimProvider
from tests.conftest import Stack


async def gpufleet(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", *args],
                                   env={**stack.settings_env(), "COLUMNS": "250"}, capture_output=True, text=True,
                                   timeout=60)


def undo_of(done: subprocess.CompletedProcess) -> str:
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("undo: ")]
    return line.removeprefix("undo: ").split("   ")[0]


async def undone(stack: Stack, done: subprocess.CompletedProcess) -> None:
    """Run the command the knob printed, exactly as printed."""
    assert done.returncode == 0, done.stderr
    command = undo_of(done)
    assert command.startswith("gpufleet sim "), command
    again = await gpufleet(stack, *command.split()[1:])
    assert again.returncode == 0, again.stderr


def knobs(stack: Stack) -> dict:
    row = stack.world.site_row("site-a")
    valid = stack.world.query("SELECT credentials_valid FROM accounts WHERE name='acct-b'")[0][0]
    return {"capacity": row["capacity"], "quota": row["quota"], "latency": row["api_latency_ms"],
            "unreachable": row["unreachable"], "valid": valid}


def machine_with_gpus(stack: Stack) -> str:
    config = load_config(stack.settings.config)
    site = config.site("site-a")
    provider = SimProvider(site, config.account(site.account), stack.world)
    machine = provider.create_machine(MachineSpec(name="site-a-faulty", site="site-a", region=site.region,
                                                  instance_type=site.instance_type, gpu=site.gpu, gpus=2), "key-1")
    return machine.name


async def test_every_knob_prints_the_command_that_undoes_it(fleet_world: Stack) -> None:
    stack = fleet_world
    node = machine_with_gpus(stack)
    before = knobs(stack)
    for args in (("capacity", "site-a", "0"), ("quota", "site-a", "1"), ("latency", "site-a", "900"),
                 ("unreachable", "site-a"), ("revoke", "acct-b")):
        done = await gpufleet(stack, "sim", *args)
        assert knobs(stack) != before, args
        await undone(stack, done)
        assert knobs(stack) == before, (args, undo_of(done))
    assert undo_of(await gpufleet(stack, "sim", "capacity", "site-a", "0")) == f"gpufleet sim capacity site-a {before['capacity']}"
    assert undo_of(await gpufleet(stack, "sim", "revoke", "acct-b")) == "gpufleet sim revoke acct-b --restore"
    assert undo_of(await gpufleet(stack, "sim", "revoke", "acct-b", "--restore")) == "gpufleet sim revoke acct-b"
    assert undo_of(await gpufleet(stack, "sim", "unreachable", "site-a")) == "gpufleet sim unreachable site-a --restore"

    fault = await gpufleet(stack, "sim", "fault", node, "--gpu", "1", "--xid", "79")
    assert undo_of(fault) == f"gpufleet sim fault {node} --gpu 1 --clear"
    assert stack.world.query("SELECT COUNT(*) FROM gpu_faults")[0][0] == 1
    await undone(stack, fault)
    assert stack.world.query("SELECT COUNT(*) FROM gpu_faults")[0][0] == 0


async def test_sim_reset_puts_every_knob_back_to_the_config(fleet_world: Stack) -> None:
    stack = fleet_world
    node = machine_with_gpus(stack)
    assert stack.world.site_row("site-a")["capacity"] == 7, "buying took one off what the site can sell"
    for args in (("capacity", "site-b", "0"), ("quota", "site-a", "1"), ("latency", "site-b", "750"),
                 ("unreachable", "site-a"), ("revoke", "acct-a"), ("fault", node, "--kind", "ecc", "--clears-on", "never")):
        assert (await gpufleet(stack, "sim", *args)).returncode == 0, args

    done = await gpufleet(stack, "sim", "reset")
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    for change in ("site-b: capacity 0 -> 8", "site-a: capacity 7 -> 8", "site-a: quota 1 -> 8",
                   "site-b: api_latency_ms 750 -> 0", "site-a: unreachable 1 -> 0",
                   "acct-a: credentials revoked -> valid", f"{node} GPU 0: ecc fault cleared"):
        assert f"reset {change}" in said, (change, done.stdout)
    assert said[-1] == "7 knob(s) reset", done.stdout
    for site in ("site-a", "site-b"):
        row = stack.world.site_row(site)
        assert (row["capacity"], row["quota"], row["api_latency_ms"], row["unreachable"], row["boot_seconds"]) == \
            (8, 8, 0, 0, 0.2), site
    assert [r[0] for r in stack.world.query("SELECT credentials_valid FROM accounts")] == [1, 1]
    assert stack.world.query("SELECT COUNT(*) FROM gpu_faults")[0][0] == 0
    assert stack.world.machine_by_name(node) is not None, "machines stay"
    again = await gpufleet(stack, "sim", "reset")
    assert again.stdout.strip() == "nothing to reset: every knob is at its default", again.stdout


def test_sim_reset_deletes_the_pods_sim_pods_add_made_and_no_others(tmp_path) -> None:
    """The tour's demand goes with the rest of the tour: `gpufleet sim reset` deletes every pod
    `gpufleet sim pods add` made (Pending or bound), and leaves a pod it did not make."""
    from typer.testing import CliRunner

    from activities.env import FleetEnv
    from cli.main import app
    from fleet.demand import GpuPod
    from fleet.settings import Settings
    from tests.conftest import write_fleet

    config = write_fleet(tmp_path)
    common = ["--state-dir", str(tmp_path), "--config", str(config)]
    runner = CliRunner()
    for args in (["llm", "--count", "2", "--gpus", "2"], ["batch", "--namespace", "jobs", "--no-opt-in"]):
        assert runner.invoke(app, ["sim", "pods", "add", *args, *common]).exit_code == 0
    env = FleetEnv.from_settings(Settings(state_dir=tmp_path, config=str(config)))
    env.cluster.create_pod(GpuPod(namespace="default", name="someone-elses", gpus=1))
    assert runner.invoke(app, ["sim", "capacity", "site-a", "0", *common]).exit_code == 0

    done = runner.invoke(app, ["sim", "reset", *common])
    assert done.exit_code == 0, done.output
    said = done.output.splitlines()
    for pod in ("default/llm-0", "default/llm-1", "jobs/batch"):
        assert f"reset {pod}: pod added by `gpufleet sim pods add` deleted" in said, done.output
    assert said[-1] == "1 knob(s) reset, 3 pod(s) deleted", done.output
    assert [p.key for p in env.cluster.list_gpu_pods()] == ["default/someone-elses"]
    again = runner.invoke(app, ["sim", "reset", *common])
    assert again.output.strip() == "nothing to reset: every knob is at its default", again.output


def test_sim_reclaim_says_it_cannot_be_undone_and_what_to_do_instead(tmp_path) -> None:
    from typer.testing import CliRunner

    from activities.env import FleetEnv
    from cli.main import app
    from fleet.settings import Settings
    from tests.conftest import TEST_FLEET, write_fleet
    from tests.repair_helpers import spot

    config = write_fleet(tmp_path, spot(TEST_FLEET))
    env = FleetEnv.from_settings(Settings(state_dir=tmp_path, config=str(config)))
    site = env.config.site("site-a")
    provider = SimProvider(site, env.config.account(site.account), env.world)
    machine = provider.create_machine(MachineSpec(name="site-a-spot", site="site-a", region=site.region,
                                                  instance_type=site.instance_type, gpu=site.gpu, gpus=1,
                                                  capacity_type=site.capacity_type), "key-r")
    done = CliRunner().invoke(app, ["sim", "reclaim", machine.name, "--seconds", "60",
                                    "--state-dir", str(tmp_path), "--config", str(config)])
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert not [line for line in lines if line.startswith("undo: ")], "no command undoes a reclaim"
    assert any(line.startswith("no undo: a spot reclaim cannot be undone") for line in lines), done.output
    assert "instead, to try it on a node you can lose: gpufleet join --site site-a, then gpufleet sim reclaim" \
        in done.output, done.output


def test_sim_reclaim_refuses_a_machine_that_is_not_spot(tmp_path) -> None:
    """A provider reclaims only spot machines, and the Node entity ignores a notice from any other
    (a bad report): posted for an on-demand machine it would reclaim nothing, so it is refused."""
    from typer.testing import CliRunner

    from activities.env import FleetEnv
    from cli.main import app
    from fleet.settings import Settings
    from tests.conftest import write_fleet

    config = write_fleet(tmp_path)
    env = FleetEnv.from_settings(Settings(state_dir=tmp_path, config=str(config)))
    site = env.config.site("site-a")
    provider = SimProvider(site, env.config.account(site.account), env.world)
    machine = provider.create_machine(MachineSpec(name="site-a-1", site="site-a", region=site.region,
                                                  instance_type=site.instance_type, gpu=site.gpu, gpus=1), "key-o")
    done = CliRunner().invoke(app, ["sim", "reclaim", machine.name, "--state-dir", str(tmp_path),
                                    "--config", str(config)])
    assert done.exit_code == 2, done.output
    assert "site-a-1 is at site-a, a site of on-demand machines: a provider reclaims only spot machines" \
        in " ".join(done.output.split()), done.output
    assert env.world.reclaim_notices() == {}
