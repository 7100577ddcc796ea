"""The serving probe in sim mode (``SimProbe``): the simulated cluster answers from its serving
state: a probe succeeds when the site's Deployment exists, is ready and has an available
replica. ``set_error_rate`` is the sim's fault knob (a "bad build"): probes to a model at a
site, optionally only while it runs a given image, fail at that rate (deterministically:
``round(rate * n)`` of ``n`` fail). The real probe: ``providers/serving_probe.py``."""

from __future__ import annotations

from fleet.rollout import ProbeResult
from providers.cluster.base import Cluster
from sim.world import SimWorld

PROBE_SCHEMA = """
CREATE TABLE IF NOT EXISTS sim_probe_faults (
    model TEXT, site TEXT, image TEXT, error_rate REAL, PRIMARY KEY (model, site, image)
);
"""


class SimProbe:
    def __init__(self, world: SimWorld, cluster: Cluster) -> None:
        self.world, self.cluster = world, cluster
        with self.world.tx() as db:
            db.executescript(PROBE_SCHEMA)

    def set_error_rate(self, model: str, site: str, rate: float, image: str = "") -> None:
        """Fail this share of probes to ``model`` at ``site`` ("" image: whatever it runs)."""
        with self.world.tx() as db:
            if rate <= 0:
                db.execute("DELETE FROM sim_probe_faults WHERE model=? AND site=? AND image=?", (model, site, image))
            else:
                db.execute("INSERT OR REPLACE INTO sim_probe_faults VALUES (?,?,?,?)", (model, site, image, rate))

    def probe(self, model: str, site: str, requests: int, timeout_s: float) -> ProbeResult:
        status = self.cluster.serving_status(model, site)
        if status is None:
            return ProbeResult(site=site, sent=requests, errors=requests, samples=["no Service for the model here"])
        if not status.ready or status.available_replicas == 0:
            return ProbeResult(site=site, sent=requests, errors=requests,
                               samples=[f"{status.available_replicas}/{status.desired_replicas} replicas available"])
        rows = self.world.query(
            "SELECT error_rate FROM sim_probe_faults WHERE model=? AND site=? AND image IN ('', ?)"
            " ORDER BY error_rate DESC", model, site, status.image,
        )
        errors = round(rows[0]["error_rate"] * requests) if rows else 0
        return ProbeResult(site=site, sent=requests, errors=errors,
                           samples=["HTTP 500 from the simulated replica"] if errors else [])
