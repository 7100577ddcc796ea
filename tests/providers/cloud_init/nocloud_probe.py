"""Run by the system's python3 with Debian's cloud-init package: cloud-init's own boot stages
(``cloud-init init --local``, then ``cloud-init init``: ``cloudinit.cmd.main.main_init``) on a
machine whose kernel command line is argv[1], NoCloud the only datasource. Prints JSON: for each
stage the datasource it found, that datasource's mode, and whether the stage went past the point
where cloud-init takes a datasource's user data as this boot's (``Init.instancify``; right before
it, a network stage whose datasource says it is in local mode exits: "datasource ... in local
mode", and the user data it fetched is never applied).

What is stubbed, and why: the stage's config points cloud-init's directories at a scratch
folder (never /var/lib/cloud or /run/cloud-init of the machine running the test); applying
network configuration, logging setup and output redirection are no-ops (they would change the
host's network and stdout); and ``instancify`` records the datasource and stops the stage there
(past it cloud-init runs the user data's modules: write_files, runcmd, on the test's host).
Everything up to that point, the datasource search and the stage's gate included, is
cloud-init's own code. stdlib and cloud-init only (not the project's venv)."""

import argparse
import json
import os
import sys
import tempfile

from cloudinit import stages, util
from cloudinit.reporting import events
from cloudinit.cmd import main as cloud_init_main

cmdline = sys.argv[1]
scratch = tempfile.mkdtemp()
config = os.path.join(scratch, "probe.cfg")
with open(config, "w") as f:
    json.dump({  # JSON is YAML: cloud-init reads it as a config file (`cloud-init init --file`)
        "datasource_list": ["NoCloud"],
        "system_info": {"paths": {"cloud_dir": os.path.join(scratch, "cloud"),
                                  "run_dir": os.path.join(scratch, "run")}},
        "def_log_file": os.path.join(scratch, "cloud-init.log"),
        "syslog_fix_perms": [],
        "disable_network_activation": True,
    }, f)


class ReachedInstancify(Exception):
    pass


def instancify(init):
    raise ReachedInstancify(init.datasource)


fetched = []
_fetch = stages.Init.fetch


def fetch(init, existing="check"):
    datasource = _fetch(init, existing=existing)  # raises DataSourceNotFoundException if none claims
    fetched.append(datasource)
    return datasource


util.get_cmdline = lambda: cmdline  # what cloud-init reads from /proc/cmdline on the machine
util.close_stdin = lambda *a, **k: None
util.fixup_output = lambda *a, **k: (None, None)
cloud_init_main.logging.setupLogging = lambda *a, **k: None
stages.Init.apply_network_config = lambda self, bring_up: None
stages.Init.instancify = instancify
stages.Init.fetch = fetch

out = {}
for stage, local in (("init-local", True), ("init", False)):
    fetched.clear()
    with open(config) as cfg:
        args = argparse.Namespace(local=local, files=[cfg], debug=False, force=False,
                                  reporter=events.ReportEventStack(stage, "probe", reporting_enabled=False))
        try:
            cloud_init_main.main_init(stage, args)
            datasource = fetched[0] if fetched else None  # found, then left by the stage's gate
            out[stage] = {"applies_user_data": False,
                          "datasource": type(datasource).__name__ if datasource else None,
                          "dsmode": getattr(datasource, "dsmode", None), "user_data": None}
        except ReachedInstancify as reached:
            datasource = reached.args[0]
            out[stage] = {"applies_user_data": True, "datasource": type(datasource).__name__,
                          "dsmode": datasource.dsmode,
                          "user_data": (datasource.userdata_raw or b"").decode()}
    if out[stage]["applies_user_data"]:
        break  # cloud-init's later stages run this datasource's user data
print(json.dumps(out))
