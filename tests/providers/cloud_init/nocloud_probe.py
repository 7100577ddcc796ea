"""Run by the system's python3 with Debian's cloud-init package: cloud-init's own NoCloud
datasources (its local stage, then its network stage) on a machine whose kernel command line is
argv[1]. Prints JSON: for each datasource whether it claimed the machine and the user data it
read. stdlib and cloud-init only (not the project's venv)."""

import json
import sys
import tempfile

from cloudinit import distros, helpers, settings, util
from cloudinit.sources import DataSourceNoCloud as nocloud

cmdline = sys.argv[1]
tmp = tempfile.mkdtemp()
paths = helpers.Paths({"cloud_dir": tmp, "run_dir": tmp})
distro = distros.fetch("debian")("debian", {}, paths)
util.get_cmdline = lambda: cmdline  # what cloud-init reads from /proc/cmdline on the machine
out = {}
for source in (nocloud.DataSourceNoCloud, nocloud.DataSourceNoCloudNet):
    datasource = source(settings.CFG_BUILTIN, distro, paths)
    found = datasource.get_data()
    out[source.__name__] = {"found": bool(found),
                            "user_data": (datasource.userdata_raw or b"").decode() if found else None}
print(json.dumps(out))
