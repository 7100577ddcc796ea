"""Spot-reclaim notice sources on a node, read by its ``watch_node`` activity.

- Sim: ``SimWorld.reclaim_notices()`` (``gpufleet sim reclaim NODE`` posts one).
- AWS: IMDSv2 ``/latest/meta-data/spot/instance-action`` (404 until a notice;
  then ``{"action": "terminate", "time": "2026-...Z"}``).
- GCP: ``computeMetadata/v1/instance/preempted`` answers ``TRUE`` (30 s notice).

The node reports a notice only as part of its state when its Node entity pulls it;
the entity starts SpotReclaim (``reclaim/<node>``) with the site and machine id the
cluster has for the node, so a node can neither start a reclaim nor name another.
"""

from __future__ import annotations

import time
from datetime import datetime

import httpx

IMDS = "http://169.254.169.254"
GCP_METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"
#: When a notice without a time was first seen: later probes report the same time.
_first_seen: dict[str, float] = {}


def aws_spot_notice(http: httpx.Client | None = None) -> float | None:
    """Termination time (epoch s) from AWS IMDSv2, or None without a notice."""
    http = http or httpx.Client(timeout=2)
    token = http.put(f"{IMDS}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}).text
    response = http.get(f"{IMDS}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token})
    if response.status_code == 404:
        return None
    response.raise_for_status()
    when = response.json().get("time")
    return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp() if when else _first_seen.setdefault("aws", time.time() + 120)



def gcp_preempted(http: httpx.Client | None = None) -> float | None:
    """30 s from when the preemption was first seen: the same time on every later probe (the
    watch returns on a changed notice, so a moving time would return it on every probe)."""
    http = http or httpx.Client(timeout=2)
    response = http.get(GCP_METADATA, headers={"Metadata-Flavor": "Google"})
    if response.status_code == 200 and response.text.strip() == "TRUE":
        return _first_seen.setdefault("gcp", time.time() + 30)
    return None


def spot_notice_source(kind: str):
    """``GPUFLEET_SPOT_NOTICE``: ``aws`` or ``gcp``; anything else: no notices."""
    if not kind:
        return None
    try:
        return {"aws": aws_spot_notice, "gcp": gcp_preempted}[kind]
    except KeyError:
        raise ValueError(f"GPUFLEET_SPOT_NOTICE: {kind!r} is not aws or gcp") from None
