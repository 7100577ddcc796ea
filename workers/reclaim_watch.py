"""Spot-reclaim notice sources on a node, read by its ``watch_node`` activity.

- Sim: ``SimWorld.reclaim_notices()`` (``gpufleet sim reclaim NODE`` posts one).
- AWS: IMDSv2 ``/latest/meta-data/spot/instance-action`` (404 until a notice;
  then ``{"action": "terminate", "time": "2026-...Z"}``).
- GCP: ``computeMetadata/v1/instance/preempted`` answers ``TRUE`` (30 s notice), ``FALSE``
  until then; the metadata server answers only a request with ``Metadata-Flavor: Google``, and
  its every answer carries that header back: one without it is from something else on the path.
- Nebius: none. Nebius documents no preemption notice a machine can read (its metadata service's
  ``instance-events`` lists maintenance events; a preempted VM gets only a shutdown signal 60 s
  before it stops), so a preemptible node there goes without SpotReclaim (docs/concepts/capacity.md).
- ``auto`` (what the shipped manifests set): the node's own provider's source, or none for a
  provider without one. The provider is the one the control plane named in the node's
  providerID (``gpufleet://<provider>/<account>/<node>``, put in the machine's user data and
  checked when it registered), as kubeadm wrote it into the kubelet's flags file.

The node reports a notice only as part of its state when its Node entity pulls it;
the entity starts SpotReclaim (``reclaim/<node>``) with the site and machine id the
cluster has for the node, so a node can neither start a reclaim nor name another.
"""

from __future__ import annotations

import logging
import shlex
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import httpx

from fleet.cluster import provider_of

log = logging.getLogger(__name__)

IMDS = "http://169.254.169.254"
#: Metadata is read straight from the link-local server, never through a proxy the node's
#: environment names (``HTTP_PROXY``): a proxy would not reach the machine's own metadata service,
#: or could answer for it with a notice of its choosing.
_DIRECT = dict(timeout=2, trust_env=False)
GCE_METADATA = "http://metadata.google.internal"
#: Where kubeadm writes the kubelet's flags (``--provider-id`` among them) on a node it joined;
#: the node agent's DaemonSet mounts it read-only.
KUBELET_FLAGS = Path("/var/lib/kubelet/kubeadm-flags.env")
#: When a notice without a time was first seen: later probes report the same time.
_first_seen: dict[str, float] = {}


def aws_spot_notice(imds: str = IMDS) -> float | None:
    """Termination time (epoch s) from AWS IMDSv2, or None without a notice."""
    with httpx.Client(**_DIRECT) as http:
        token = http.put(f"{imds}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
        token.raise_for_status()
        response = http.get(f"{imds}/latest/meta-data/spot/instance-action",
                            headers={"X-aws-ec2-metadata-token": token.text})
    if response.status_code == 404:
        return None
    response.raise_for_status()
    when = response.json().get("time")
    return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp() if when else _first_seen.setdefault("aws", time.time() + 120)


class NotTheMetadataServer(Exception):
    """What answered at the metadata address is not the provider's metadata server."""


#: The sources already warned of an impostor: it is logged once, not at every probe.
_impostors_warned: set[str] = set()


def gcp_preempted(metadata: str = GCE_METADATA) -> float | None:
    """30 s from when the preemption was first seen: the same time on every later probe (the
    watch returns on a changed notice, so a moving time would return it on every probe).
    Anything but ``200 TRUE`` (``FALSE``, a missing key, an error page) is no notice.

    GCE's metadata server sets ``Metadata-Flavor: Google`` on every answer (Google's own clients
    check it the same way). An answer without it (a proxy, a captive portal, a pod listening on
    the link-local address) is neither a notice nor "no notice": it raises, as a server that does
    not answer does, and the watch reports no notice and asks again at its next probe."""
    with httpx.Client(**_DIRECT) as http:
        response = http.get(f"{metadata}/computeMetadata/v1/instance/preempted",
                            headers={"Metadata-Flavor": "Google"})
    if response.headers.get("Metadata-Flavor") != "Google":
        if "gcp" not in _impostors_warned:
            _impostors_warned.add("gcp")
            log.warning("spot notices: %s answered (HTTP %d) without the 'Metadata-Flavor: Google' header GCE's "
                        "metadata server always sends: something else answers there (a proxy, a captive portal, "
                        "a pod on the link-local address); its answers are not read until it does",
                        metadata, response.status_code)
        raise NotTheMetadataServer(f"{metadata}: an answer without 'Metadata-Flavor: Google' is not GCE's")
    if response.status_code == 200 and response.text.strip() == "TRUE":
        return _first_seen.setdefault("gcp", time.time() + 30)
    return None


#: The providers whose machines read a spot notice, each with its source.
SOURCES: dict[str, Callable[[], float | None]] = {"aws": aws_spot_notice, "gcp": gcp_preempted}


def node_provider(flags: Path = KUBELET_FLAGS) -> str | None:
    """The provider in this node's gpufleet providerID, from the kubelet's flags file; None on a
    node gpufleet did not join (no such file, or another providerID)."""
    try:
        text = flags.read_text()
    except OSError:
        return None
    for line in text.splitlines():  # KUBELET_KUBEADM_ARGS="--flag=value --flag=value ..."
        _name, _, value = line.partition("=")
        try:
            args = [arg for quoted in shlex.split(value) for arg in quoted.split()]
        except ValueError:
            continue
        for arg in args:
            flag, _, provider_id = arg.partition("=")
            if flag == "--provider-id":
                return provider_of(provider_id)
    return None


def spot_notice_source(kind: str, flags: Path = KUBELET_FLAGS) -> Callable[[], float | None] | None:
    """``GPUFLEET_SPOT_NOTICE``: ``auto`` (the node's provider's), ``aws`` or ``gcp``; unset: none."""
    if not kind:
        return None
    if kind == "auto":
        provider = node_provider(flags)
        source = SOURCES.get(provider or "")
        if provider is None:
            log.info("spot notices: none (no gpufleet providerID in %s)", flags)
        else:
            log.info("spot notices: %s", f"{provider}'s metadata" if source else f"none ({provider} has no spot notice source)")
        return source
    try:
        return SOURCES[kind]
    except KeyError:
        raise ValueError(f"GPUFLEET_SPOT_NOTICE: {kind!r} is not auto, aws or gcp") from None
