"""``gpufleet config check``: every problem names the site and the field; exit 2."""

from __future__ import annotations

import copy
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from fleet.config import ConfigError, load_config, parse_config
from fleet.messages.evacuation import SiteEvacuationInput
from fleet.messages.repair import GpuRepairInput, NodeEntityInput
from fleet.messages.watches import RecoveryWatchInput
from tests.conftest import TEST_FLEET, write_fleet
from workflows.inputs import MAX_NUMBER, parse_input

REPO = Path(__file__).resolve().parents[1]


def check(tmp_path: Path, fleet: dict) -> tuple[int, str]:
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet))
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    return result.exit_code, result.output


def broken(change) -> dict:
    fleet = copy.deepcopy(TEST_FLEET)
    change(fleet)
    return fleet


CASES = {
    "min above max": (lambda f: f["sites"][1].update(min_nodes=9, max_nodes=3),
                      ["sites[1] (site-b).min_nodes", "min_nodes (9) is greater than max_nodes (3)"]),
    "unknown provider": (lambda f: f["sites"][0].update(provider="azure"),
                         ["sites[0] (site-a).provider", "unknown provider 'azure'"]),
    "duplicate site": (lambda f: f["sites"].append(copy.deepcopy(f["sites"][0])),
                       ["sites[2] (site-a).name", "duplicate site"]),
    "negative price": (lambda f: f["sites"][1].update(price_per_gpu_hour=-1),
                       ["sites[1] (site-b).price_per_gpu_hour", "greater than or equal to 0"]),
    "missing account reference": (lambda f: f["sites"][0].pop("account"),
                                  ["sites[0] (site-a).account", "missing account reference"]),
    "unknown account": (lambda f: f["sites"][0].update(account="nobody"),
                        ["sites[0] (site-a).account", "unknown account reference 'nobody'"]),
    "unknown key": (lambda f: f["sites"][1].update(gpu_count=8),
                    ["sites[1] (site-b).gpu_count", "unknown key"]),
    "unknown key in sim block": (lambda f: f["sites"][0]["sim"].update(capacty=3),
                                 ["sites[0] (site-a).sim.capacty", "unknown key"]),
    # The join writes these as node labels and names nodes after the site: refused at load, not
    # by the API server after the machine was bought.
    "gpu not a label value": (lambda f: f["sites"][1].update(gpu="H100 SXM"),
                              ["sites[1] (site-b).gpu", "'H100 SXM' is not a Kubernetes label value"]),
    "region not a label value": (lambda f: f["sites"][1].update(region="eu-north1 "),
                                 ["sites[1] (site-b).region", "'eu-north1 ' is not a Kubernetes label value"]),
    "site name not a node name": (lambda f: f["sites"][0].update(name="US_East"),
                                  ["sites[0] (US_East).name", "'US_East' cannot name nodes",
                                   "lowercase DNS label"]),
    "site name too long for its nodes' names": (lambda f: f["sites"][0].update(name="a" * 55),
                                                [f"sites[0] ({'a' * 55}).name", "at most 54 characters, not 55",
                                                 "hostname label"]),
    # What YAML's block scalar (``gpu: |``) or a quoted "\n" gives: no label value or node name ends
    # in a line break (the checks' ``$`` took one before it).
    "site name ending in a line break": (lambda f: f["sites"][0].update(name="site-a\n"),
                                         [".name", "'site-a\\n' cannot name nodes"]),
    "gpu ending in a line break": (lambda f: f["sites"][1].update(gpu="H100\n"),
                                   ["sites[1] (site-b).gpu", "'H100\\n' is not a Kubernetes label value"]),
    "region ending in a line break": (lambda f: f["sites"][1].update(region="eu-north1\n"),
                                      ["sites[1] (site-b).region", "'eu-north1\\n' is not a Kubernetes label value"]),
    # The join writes the geography as a node label too (``LABEL_GEOGRAPHY``).
    "geography not a label value": (lambda f: f["sites"][1].update(geography="EU West"),
                                    ["sites[1] (site-b).geography", "'EU West' is not a Kubernetes label value"]),
}


@pytest.mark.parametrize("name", CASES)
def test_config_check_names_site_and_field(tmp_path: Path, name: str) -> None:
    change, expected = CASES[name]
    code, output = check(tmp_path, broken(change))
    assert code == 2, output
    for text in expected:
        assert text in output


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    def two_problems(f):
        f["sites"][0]["price_per_gpu_hour"] = -2
        f["sites"][1]["provider"] = "gcp"

    code, output = check(tmp_path, broken(two_problems))
    assert code == 2
    assert "site-a" in output and "site-b" in output


def test_shipped_configs_are_valid() -> None:
    example = load_config(REPO / "deploy" / "sites.example.yaml")
    assert example.mode == "real" and len({s.provider for s in example.sites}) == 5
    builtin = load_config(None)
    assert builtin.mode == "sim"
    assert len(builtin.sites) >= 5 and len({s.provider for s in builtin.sites}) >= 4
    assert {"spot", "owned"} <= {s.capacity_type.value for s in builtin.sites}
    assert len({s.price_per_gpu_hour for s in builtin.sites}) == len(builtin.sites)


def test_the_longest_site_name_and_label_values_load() -> None:
    fleet = broken(lambda f: f["sites"][0].update(name="a" * 54, gpu="NVIDIA-H100-80GB-HBM3", region="us_east.1"))
    assert parse_config(fleet).sites[0].name == "a" * 54


def test_a_model_routed_to_more_than_16_sites_is_refused(tmp_path: Path) -> None:
    """The model's HTTPRoute has one backendRef per site serving it, and Gateway API allows 16."""
    def seventeen(f):
        f["sites"] += [{**f["sites"][0], "name": f"site-{i}"} for i in range(15)]
        names = [s["name"] for s in f["sites"]]
        f["models"] = {"llama": {"mode": "burst", "sites": names[:9], "standby_sites": names[9:]}}

    code, output = check(tmp_path, broken(seventeen))
    assert code == 2, output
    assert "models.llama: sites and standby_sites: 17 sites; a model is routed to at most 16" in " ".join(output.split())
    sixteen = broken(seventeen)
    sixteen["models"]["llama"]["standby_sites"].pop()
    assert parse_config(sixteen).models["llama"].standby_sites


def test_models_of_one_kubernetes_name_are_refused(tmp_path: Path) -> None:
    """The Kubernetes adapter names a model's Deployments, Services and route after its DNS
    label: two models of one label would write each other's objects."""
    def clash(f):
        policy = {"sites": [f["sites"][0]["name"]]}
        f["models"] = {"Llama-3-8B": policy, "llama-3-70b": policy, "llama_3_8b": policy}

    code, output = check(tmp_path, broken(clash))
    assert code == 2, output
    assert "models: 'Llama-3-8B' and 'llama_3_8b' are one Kubernetes name (llama-3-8b)" in " ".join(output.split())
    assert "llama-3-70b" not in output
    apart = broken(clash)
    del apart["models"]["llama_3_8b"]
    assert set(parse_config(apart).models) == {"Llama-3-8B", "llama-3-70b"}


def test_models_whose_sites_give_one_serving_name_are_refused(tmp_path: Path) -> None:
    """The Kubernetes adapter names a model's Deployment, Service and PodDisruptionBudget at a
    site ``<model>-<site>``: ``a-b`` at ``c`` and ``a`` at ``b-c`` would write one set of them."""
    def clash(f):
        f["sites"] += [{**f["sites"][0], "name": "c"}, {**f["sites"][0], "name": "b-c"}]
        f["models"] = {"a-b": {"sites": ["c"]}, "a": {"sites": ["site-a", "b-c"]}}

    code, output = check(tmp_path, broken(clash))
    assert code == 2, output
    # (yaml.safe_dump writes the models in name order: a, then a-b)
    assert "models.a-b.sites: 'a' at b-c and 'a-b' at c are one Kubernetes name (a-b-c)" in " ".join(output.split())
    apart = broken(clash)
    apart["models"]["a"]["sites"] = ["site-a", "c"]
    assert parse_config(apart).models["a"].sites == ["site-a", "c"]


def test_a_models_site_whose_serving_name_is_another_models_own_is_refused(tmp_path: Path) -> None:
    """The model-wide Service is named after the model, ``a-b``; model ``a``'s Service at site ``b``
    is ``a-b`` too, and the per-site one takes it over: ``a-b``'s clients would reach ``a``."""
    def clash(f):
        f["sites"] += [{**f["sites"][0], "name": "b"}]
        f["models"] = {"a-b": {"sites": ["site-a"]}, "a": {"sites": ["b"]}}

    code, output = check(tmp_path, broken(clash))
    assert code == 2, output
    assert "models.a.sites: 'a' at b and model 'a-b' name one Service (a-b)" in " ".join(output.split())
    apart = broken(clash)
    apart["models"]["a"]["sites"] = ["site-a"]
    assert parse_config(apart).models["a"].sites == ["site-a"]


def test_real_mode_needs_credentials_references(tmp_path: Path) -> None:
    fleet = broken(lambda f: (f.update(mode="real"), f["accounts"][0].pop("credentials")))
    code, output = check(tmp_path, fleet)
    assert code == 2
    assert "accounts[0] (acct-a).credentials" in output


@pytest.mark.parametrize(("provider", "option"), [("lambda", "ssh_key_names"), ("nebius", "parent_id"),
                                                ("nebius", "subnet_id")])
def test_a_cloud_account_that_can_join_needs_the_options_its_launch_takes(tmp_path: Path, provider: str,
                                                                          option: str) -> None:
    """Lambda launches no instance without an SSH key name, Nebius none without its project and
    subnet: the adapters refused every create after the worker started (each fill failing, a site
    with ``min_nodes`` retrying for ever). Refused at load, naming the option and the sites."""
    example = yaml.safe_load((REPO / "deploy" / "sites.example.yaml").read_text())
    ((index, account),) = [(i, a) for i, a in enumerate(example["accounts"]) if a["provider"] == provider]
    account["options"].pop(option)
    code, output = check(tmp_path, example)
    flat = " ".join(output.split())
    assert code == 2, flat
    assert f"accounts[{index}] ({account['name']}).options.{option}: missing; {provider} needs" in flat, flat
    sites = [s for s in example["sites"] if s["account"] == account["name"]]
    assert f"without it every join at {', '.join(s['name'] for s in sites)} fails" in flat, flat
    for site in sites:
        site.update(min_nodes=0, max_nodes=0)
    assert check(tmp_path, example)[0] == 0, "a site that never joins launches nothing"


def test_an_own_rack_account_that_can_join_needs_its_seed_dir(tmp_path: Path) -> None:
    """Without ``seed_dir`` the own-dc adapter refuses every join (the seed is the machine's only
    way to its bootstrap): refused at load, naming the option, not after the worker started."""
    example = yaml.safe_load((REPO / "deploy" / "sites.example.yaml").read_text())
    ((index, account),) = [(i, a) for i, a in enumerate(example["accounts"]) if a["provider"] == "own-dc"]
    account["options"].pop("seed_dir", None)
    code, output = check(tmp_path, example)
    flat = " ".join(output.split())
    assert code == 2, flat
    assert f"accounts[{index}] ({account['name']}).options.seed_dir: missing" in flat
    assert "without it every join at own-dc-ber fails" in flat
    # A site that never joins (max_nodes 0), or a simulated fleet, hands no seed to anyone.
    (site,) = [s for s in example["sites"] if s["account"] == account["name"]]
    site.update(min_nodes=0, max_nodes=0)
    assert check(tmp_path, example)[0] == 0
    site.update(min_nodes=2, max_nodes=2)
    assert check(tmp_path, {**example, "mode": "sim"})[0] == 0


#: (where in sites.yaml, the YAML written there, what the refusal says). Each loaded before and
#: wedged every Site entity: an infinite number reaches workflows as null, which none can decode
#: (``incident_settings``' result, an offer's price), and a huge finite wait overflowed
#: ``timedelta`` inside the ``admit_repair`` handler.
UNUSABLE_NUMBERS = [
    ("incident.window_seconds", ".inf", "finite number"),
    ("incident.window_seconds", "1.0e+400", "finite number"),
    ("incident.settle_seconds", "1.0e+14", "less than or equal to 2592000"),
    ("sites[1] (site-b).incident.settle_seconds", "1.0e+14", "less than or equal to 2592000"),
    ("repair.timeouts.reset_seconds", ".inf", "finite number"),
    ("repair.thresholds.same_xid_window_seconds", "1.0e+14", "less than or equal to 2592000"),
    ("sites[0] (site-a).price_per_gpu_hour", ".inf", "finite number"),
    ("sites[0] (site-a).price_per_gpu_hour", "1.0e+300", "less than or equal to 100000"),
]


@pytest.mark.parametrize("where, written, refusal", UNUSABLE_NUMBERS)
def test_a_number_no_workflow_can_use_is_refused_naming_the_field(tmp_path: Path, where: str, written: str,
                                                                 refusal: str) -> None:
    fleet = copy.deepcopy(TEST_FLEET)
    *parents, field = where.replace(" (site-a)", "").replace(" (site-b)", "").split(".")
    block = fleet
    for step in parents:
        name, _, index = step.partition("[")
        block = block.setdefault(name, {})
        block = block[int(index.rstrip("]"))] if index else block
    block[field] = "@number@"
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet).replace("'@number@'", written))
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert any(p.startswith(f"{where}: ") and refusal in p for p in refused.value.problems), refused.value.problems
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2 and where in result.output, result.output


def test_a_min_nodes_one_fill_cannot_buy_is_refused_naming_the_field(tmp_path: Path) -> None:
    """A Site entity below its min starts one fill (AcquireCapacity) for the nodes it lacks, and a
    capacity request buys at most 256 machines. Before, `min_nodes: 300` loaded (and `config check`
    passed) and every fill of the site failed at its start ("invalid CapacityRequest: count: Input
    should be less than or equal to 256"), one after another: the site never got a node."""
    from fleet.messages.acquire import CapacityRequest

    CapacityRequest(count=256)
    with pytest.raises(ValueError):
        CapacityRequest(count=257)
    path = write_fleet(tmp_path, broken(lambda f: f["sites"][1].update(min_nodes=300, max_nodes=400)))
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.problems == [
        "sites[1] (site-b).min_nodes: 300 is more than 256, the most one capacity request buys: the site's "
        "entity fills its min with one request, which would be refused every time"]
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2 and "sites[1] (site-b).min_nodes" in result.output, result.output
    # As many as one request buys loads.
    write_fleet(tmp_path, broken(lambda f: f["sites"][1].update(min_nodes=256, max_nodes=400)))
    assert load_config(path).sites[1].min_nodes == 256


@pytest.mark.parametrize("written", ["9007199254740993", "1.0e+17", "5001"])
def test_a_max_nodes_past_what_the_cluster_holds_is_refused_naming_the_field(tmp_path: Path, written: str) -> None:
    """Before, any max_nodes loaded and `config check` passed: one past 2**53 (or a float as big, which
    the model takes as an int) went into the Site entity's state (SiteStatus.max_nodes), which the
    workers' input guard refuses at every workflow start, so the entity would fail when it continued
    as new. Now a site's max is at most 5,000, the nodes the fleet's one Kubernetes cluster is built
    for; a Site decoded from a recorded activity result still takes any number."""
    from fleet.config import Site
    from fleet.messages.capacity import SiteInput, SiteState, SiteStatus
    from workflows.inputs import first_problem

    huge = 2**53 + 1
    carried = SiteInput(site="site-b", state=SiteState(status=SiteStatus(site="site-b", max_nodes=huge)))
    assert first_problem(carried.model_dump(mode="json")) == (
        "state.status.max_nodes", f"must be between -{MAX_NUMBER} and {MAX_NUMBER}"), "what the entity would meet"
    assert Site.model_validate({**TEST_FLEET["sites"][1], "max_nodes": huge}).max_nodes == huge

    fleet = copy.deepcopy(TEST_FLEET)
    fleet["sites"][1]["max_nodes"] = "@max@"
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(fleet).replace("'@max@'", written))
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    shown = float(written) if "." in written else int(written)
    assert refused.value.problems == [
        f"sites[1] (site-b).max_nodes: {shown} is more than 5000, the most nodes the fleet's one Kubernetes "
        "cluster is built for (every site's nodes join it); the site's entity carries its max over "
        "continue-as-new, where a number past 2**53 is refused"]
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2 and "sites[1] (site-b).max_nodes: " in result.output, result.output
    # As many as the cluster holds loads.
    path.write_text(yaml.safe_dump(fleet).replace("'@max@'", "5000"))
    assert load_config(path).sites[1].max_nodes == 5000


def test_workflow_inputs_take_a_setting_past_the_cap_that_sites_yaml_refuses() -> None:
    """The caps hold where a person writes the value. An input an older release recorded (a 60-day
    window its sites.yaml had) must still parse on replay, or every open Node entity and repair that
    recorded it is stuck once the operator lowers it; and a raw start's wait, however long the input
    guard lets it be, parses as one workflow code can add to a time without overflowing, or pass
    on to the watch it starts."""
    settings = {"thresholds": {"node_remediation_window_seconds": 60 * 86400},
                "timeouts": {"contain_seconds": float(MAX_NUMBER)}}
    repair = parse_input(GpuRepairInput, {"node_name": "site-a-1a2b3c4d", "gpu": 0, "site": "site-a",
                                          "settings": settings})
    entity = parse_input(NodeEntityInput, {"node_name": "site-a-1a2b3c4d", "settings": settings})
    evacuation = parse_input(SiteEvacuationInput, {"site": "site-a", "settings": {
        "window_seconds": 60 * 86400, "settle_seconds": 1e14, "probe_seconds": 2 * 86400}})
    assert repair.settings.thresholds.node_remediation_window_seconds == 60 * 86400
    assert entity.settings is not None and evacuation.settings is not None
    assert evacuation.settings.window_seconds == 60 * 86400
    now = datetime.now(timezone.utc)
    for wait in (repair.settings.timeouts.contain_seconds, entity.settings.timeouts.contain_seconds,
                 evacuation.settings.settle_seconds):
        assert now + timedelta(seconds=wait) > now + timedelta(days=365)
    # As the evacuation builds its recovery watch (whose input takes no more than a day).
    RecoveryWatchInput(site="site-a", probe_seconds=evacuation.settings.probe_seconds)


def test_unreadable_and_non_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("sites: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    # Before: a RecursionError out of the parser, a traceback for `config check` and each worker.
    (tmp_path / "deep.yaml").write_text("sites: " + "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match="not valid YAML: nested too deeply"):
        load_config(tmp_path / "deep.yaml")


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    """YAML keeps a repeated key's last value without a word. Before, a second `sites:` block (a new
    site pasted at the end, with its header) loaded as the fleet without every site of the first one,
    and `config check` passed; a `max_nodes` given twice in a site took the second, the first lost."""
    text = yaml.safe_dump(TEST_FLEET, sort_keys=False)
    pasted = text + "sites:\n" + yaml.safe_dump([{**TEST_FLEET["sites"][0], "name": "site-c"}])
    path = tmp_path / "sites.yaml"
    path.write_text(pasted)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    first, second = (i + 1 for i, line in enumerate(pasted.splitlines()) if line == "sites:")
    assert refused.value.problems == [f"sites: given twice (lines {first} and {second}); YAML keeps only the last, "
                                      "so the first would be lost: keep one"]
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2 and "sites: given twice" in result.output, result.output

    # In a site, named as a field error is; said together with the file's other problems.
    path.write_text(text.replace("  max_nodes: 8\n", "  max_nodes: 8\n  max_nodes: 80\n", 1)
                    .replace("price_per_gpu_hour: 2.9", "price_per_gpu_hour: -1"))
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.problems[0].startswith("sites[0] (site-a).max_nodes: given twice (lines "), refused.value.problems
    assert any(p.startswith("sites[1] (site-b).price_per_gpu_hour: ") for p in refused.value.problems)

    # A key a merged mapping (`<<: *store`) gives and the mapping sets again is an override.
    fleet = copy.deepcopy(TEST_FLEET)
    fleet["object_stores"] = {"w": "@store@"}
    fleet["sites"][0]["object_store"] = "@site-store@"
    path.write_text(yaml.safe_dump(fleet).replace("'@store@'", "&s3 {bucket: weights, region: eu-1}")
                    .replace("'@site-store@'", "{<<: *s3, bucket: site-a-weights}"))
    store = load_config(path).sites[0].object_store
    assert store is not None and (store.bucket, store.region) == ("site-a-weights", "eu-1")


@pytest.mark.parametrize("written, shown", [("on", "True is a boolean"), ("yes", "True is a boolean"),
                                            ("1", "1 is a number"), ("2024-01-01", "2024-01-01 is a date")])
def test_a_key_yaml_reads_as_no_string_is_refused_naming_where(tmp_path: Path, written: str, shown: str) -> None:
    """Before, such a key at the top of the file ended `gpufleet config check` (and each worker's
    start) with a traceback (IndexError in naming where the schema's error was); in `models` it was
    named `models[1].[key]`, as if a list's entry."""
    path = tmp_path / "sites.yaml"
    text = yaml.safe_dump(TEST_FLEET)
    path.write_text(f"{written}: true\n" + text)
    result = CliRunner().invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert f"(top level): the key {shown} to YAML, not a string" in " ".join(result.output.split()), result.output
    path.write_text(text + f"models:\n  {written}: {{sites: [site-a]}}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.problems[0].startswith(f"models: the key {shown} to YAML, not a string"), \
        refused.value.problems


def test_console_script_exit_code(tmp_path: Path) -> None:
    """The installed command, as a person runs it."""
    path = tmp_path / "sites.yaml"
    path.write_text(yaml.safe_dump(broken(lambda f: f["sites"][0].update(min_nodes=5, max_nodes=1))))
    bad = subprocess.run([sys.executable, "-m", "cli", "config", "check", str(path)], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "site-a" in bad.stderr and "max_nodes" in bad.stderr
    good = subprocess.run([sys.executable, "-m", "cli", "config", "check", str(REPO / "deploy/sites.example.yaml")],
                          capture_output=True, text=True)
    assert good.returncode == 0, good.stderr


#: What an account of each provider must set for its sites to join (``fleet.models.JOIN_OPTIONS``).
JOINING_OPTIONS = {"lambda": {"ssh_key_names": ["ops-key"]},
                   "nebius": {"parent_id": "project-e00test", "subnet_id": "vpcsubnet-e00test"}}


def _real_fleet(*sites: dict) -> dict:
    accounts = {s["account"]: s["provider"] for s in sites}
    return {"mode": "real",
            "accounts": [{"name": name, "provider": provider, "credentials": {"env": "X"},
                          "options": JOINING_OPTIONS.get(provider, {})}
                         for name, provider in accounts.items()],
            "sites": [{"region": "r1", "gpu": "H100", "gpus_per_machine": 8, "instance_type": "t",
                       "price_per_gpu_hour": 2.0, "max_nodes": 2, **s} for s in sites]}


def test_real_mode_warns_of_stock_images_without_kubeadm(tmp_path: Path) -> None:
    fleet = _real_fleet(
        {"name": "hz-stock", "provider": "hetzner", "account": "hz"},  # the adapter's default: ubuntu-24.04
        {"name": "hz-snapshot", "provider": "hetzner", "account": "hz", "image": "123456789"},
        {"name": "nb-cuda", "provider": "nebius", "account": "nb", "image": "ubuntu22.04-cuda12"},
        {"name": "nb-own", "provider": "nebius", "account": "nb", "image": "computeimage-e00prepared"},
        {"name": "lambda", "provider": "lambda", "account": "la", "image": "family:lambda-stack"},
        {"name": "aws", "provider": "aws", "account": "aw", "image": "ami-0123456789abcdef0"},
    )
    code, output = check(tmp_path, fleet)
    assert code == 0, output
    flat = " ".join(output.split())
    warned = {line.split("(")[1].split(")")[0] for line in flat.split("warning: ")[1:]}
    assert warned == {"hz-stock", "nb-cuda", "lambda"}, flat
    assert "ubuntu-24.04 is a stock hetzner image without kubeadm or the NVIDIA driver" in flat
    assert "pins no sha256 for kubelet, kubeadm" in flat and "Lambda boots only its own images" in flat
    fleet["mode"] = "sim"
    code, output = check(tmp_path, fleet)
    assert code == 0 and "warning" not in output


def test_real_mode_warns_of_a_spot_site_whose_machines_post_no_reclaim_notice(tmp_path: Path) -> None:
    """Nebius documents no preemption notice a machine can read: a spot site there gets no drain
    ahead of a reclaim, and the operator who chose spot for it is told so where they check the file.
    AWS posts one (the agent reads it); an on-demand Nebius site has nothing to be reclaimed."""
    fleet = _real_fleet(
        {"name": "nb-spot", "provider": "nebius", "account": "nb", "image": "computeimage-e00prepared",
         "capacity_type": "spot"},
        {"name": "nb-regular", "provider": "nebius", "account": "nb", "image": "computeimage-e00prepared"},
        {"name": "aws-spot", "provider": "aws", "account": "aw", "image": "ami-0123456789abcdef0",
         "capacity_type": "spot"},
    )
    code, output = check(tmp_path, fleet)
    flat = " ".join(output.split())
    assert code == 0, flat
    assert flat.count("warning: ") == 1, flat
    assert "warning: sites[0] (nb-spot).capacity_type: spot at a nebius site" in flat
    assert "no SpotReclaim drains one ahead" in flat and "docs/concepts/capacity.md" in flat
    assert "replaced only at the next site sweep" in flat
    fleet["mode"] = "sim"  # the simulated fleet posts its own notices, at any provider
    code, output = check(tmp_path, fleet)
    assert code == 0 and "warning" not in output


def test_real_mode_warns_of_a_driver_reinstall_the_base_node_agent_may_not_run(tmp_path: Path) -> None:
    """``reinstall_via: agent`` runs the node image's script through the node agent, which the
    shipped DaemonSet may do only with deploy/driver-reinstall (the chart's
    nodeAgent.driverReinstall); without it every such rung failed at the node with no word before.
    The operator is told where they check the file, with what each site's image needs."""
    from fleet.repair_policy import DRIVER_REINSTALL_SCRIPT

    fleet = _real_fleet({"name": "aws", "provider": "aws", "account": "aw", "image": "ami-0123456789abcdef0"},
                        {"name": "nb", "provider": "nebius", "account": "nb", "image": "computeimage-e00prepared"})
    code, output = check(tmp_path, fleet)
    assert code == 0 and "warning" not in output, output
    fleet["repair"] = {"reinstall_via": "agent"}
    code, output = check(tmp_path, fleet)
    flat = " ".join(output.split())
    assert code == 0, flat
    assert flat.count("warning: ") == 1, flat
    assert f"warning: repair.reinstall_via: agent: a driver reinstall runs {DRIVER_REINSTALL_SCRIPT}" in flat
    assert "deploy/driver-reinstall" in flat and "nodeAgent.driverReinstall=true" in flat
    assert "(sites: aws, nb;" in flat and "Driver reinstall" in flat
    fleet["mode"] = "sim"  # the simulated agents reinstall without a DaemonSet
    code, output = check(tmp_path, fleet)
    assert code == 0 and "warning" not in output


def test_stock_image_warning_follows_the_pins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from providers.cluster.bootstrap import DEFAULT_NODE_INSTALL

    pins = yaml.safe_load(DEFAULT_NODE_INSTALL.read_text())
    pins["sha256"] = {arch: {part: "a" * 64 for part in pins["sha256"][arch]} for arch in pins["sha256"]}
    (tmp_path / "pins.yaml").write_text(yaml.safe_dump(pins))
    monkeypatch.setenv("GPUFLEET_NODE_INSTALL", str(tmp_path / "pins.yaml"))
    code, output = check(tmp_path, _real_fleet({"name": "nb-cuda", "provider": "nebius", "account": "nb"}))
    flat = " ".join(output.split())
    assert code == 0 and "install kubelet, kubeadm and containerd at first boot" in flat, flat


def test_the_default_images_are_the_adapters() -> None:
    from fleet.config import DEFAULT_IMAGES
    from providers import hetzner, nebius

    assert DEFAULT_IMAGES == {"hetzner": ("image", hetzner.DEFAULT_IMAGE),
                              "nebius": ("image_family", nebius.DEFAULT_IMAGE_FAMILY)}


def test_the_example_config_boots_prepared_images_where_the_provider_takes_them(tmp_path: Path) -> None:
    from fleet.config import stock_images

    example = load_config(REPO / "deploy" / "sites.example.yaml")
    assert [s.provider for s in stock_images(example)] == ["lambda"], "Lambda takes no image of yours"


# -- against the fleet running now (`--fleet`) -------------------------------------------------
def _join_sim_node(cluster, name: str, site: str) -> None:
    """A node registered and labelled for ``site`` as a join leaves it, with its identity record."""
    from fleet.cluster import LABEL_SITE, NODE_IDENTITY_KIND, NodeIdentity

    machine = f"m-{name}"
    cluster.create_join_token(name, machine, 600)
    cluster.register_with_token(machine, cluster.world.take_bootstrap_token(machine), "boot-1", 2)
    cluster.label_node(name, {LABEL_SITE: site})
    identity = NodeIdentity(node_name=name, machine_id=machine, provider="nebius", account="acct-b", site=site)
    cluster.update_state(NODE_IDENTITY_KIND, name, lambda _old: identity.state())


def test_check_against_the_fleet_refuses_dropping_a_site_that_still_has_nodes(tmp_path: Path) -> None:
    """Applied, a config without site-b would leave its two nodes to nobody: no Site entity, no
    sweep, no spend figure, and their machines billed for ever. The check names the site, its
    nodes and the machine of a node already gone whose record remains, and says how to empty it;
    the same file passes once the site has nothing left."""
    from activities.env import FleetEnv
    from fleet.cluster import NODE_IDENTITY_KIND, NodeIdentity
    from fleet.settings import Settings

    state = tmp_path / "state"
    env = FleetEnv.from_settings(Settings(state_dir=state, config=str(write_fleet(tmp_path))))
    for name, site in (("site-a-n1", "site-a"), ("site-b-n1", "site-b"), ("site-b-n2", "site-b")):
        _join_sim_node(env.cluster, name, site)
    gone = NodeIdentity(node_name="site-b-n3", machine_id="vm-still-billed", provider="nebius", account="acct-b",
                        site="site-b")
    env.cluster.update_state(NODE_IDENTITY_KIND, "site-b-n3", lambda _old: gone.state())

    dropped = tmp_path / "dropped.yaml"
    dropped.write_text(yaml.safe_dump({**TEST_FLEET, "sites": TEST_FLEET["sites"][:1]}))

    def check_fleet(path: Path):
        return CliRunner().invoke(app, ["config", "check", str(path), "--fleet", "--state-dir", str(state)],
                                  env={"COLUMNS": "400"})

    offline = CliRunner().invoke(app, ["config", "check", str(dropped)])
    assert offline.exit_code == 0, "without --fleet the file alone is checked"
    refused = check_fleet(dropped)
    flat = " ".join(refused.output.split())
    assert refused.exit_code == 1, refused.output
    assert "site-b: not in" in flat and "2 node(s) there (site-b-n1, site-b-n2)" in flat, flat
    assert "site-b-n3: machine vm-still-billed" in flat, flat
    assert "with min_nodes: 0 and max_nodes: 0, until it has none" in flat and "Changing the fleet config" in flat, flat
    assert "site-a:" not in flat, "a site the file keeps is not named"
    # Applied anyway, `gpufleet sites` (which lists the config's sites) still names it.
    from tests.ports import free_port

    shown = CliRunner().invoke(app, ["sites", "--state-dir", str(state), "--config", str(dropped),
                                     "--address", f"127.0.0.1:{free_port()}"], env={"COLUMNS": "400"})
    assert "warning: site-b: not in the fleet config, but the cluster still has 2 node(s)" in \
        " ".join(shown.output.split()), shown.output

    emptying = tmp_path / "emptying.yaml"
    sites = copy.deepcopy(TEST_FLEET["sites"])
    sites[1].update(min_nodes=0, max_nodes=0)
    emptying.write_text(yaml.safe_dump({**TEST_FLEET, "sites": sites}))
    assert check_fleet(emptying).exit_code == 0, "keeping the site at 0 is the way to empty it"

    for name in ("site-b-n1", "site-b-n2"):
        env.cluster.remove_node(name)  # retired: its identity record goes with it
    env.cluster.delete_state(NODE_IDENTITY_KIND, "site-b-n3")  # the fleet sweep's, once its machine is gone
    emptied = check_fleet(dropped)
    assert emptied.exit_code == 0, emptied.output
    assert "every site the running fleet has nodes at is in" in " ".join(emptied.output.split())


def test_check_against_no_fleet_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["config", "check", str(write_fleet(tmp_path)), "--fleet",
                                      "--state-dir", str(tmp_path / "none")])
    assert result.exit_code == 2 and "no simulated fleet at" in result.output, result.output
