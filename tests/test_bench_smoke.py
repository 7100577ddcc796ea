"""Benchmarks that cannot rot: every bench in bench/ runs at its smoke size in the suite, as an
operator runs it (``python -m bench.<name> ...``), and fails the suite when it crashes or stops
printing its figures. The smoke size proves the bench still works, not its targets: seconds of
measurement say nothing about a ratio, so the benches print their targets but do not fail on
them at that size (at full size they do, where they always did)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tools import needs

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

NUMBER = r"[0-9][0-9,.]*"


@dataclass(frozen=True)
class Smoke:
    args: tuple[str, ...]
    #: Regular expressions the output must match: the bench's figures, each with a number.
    figures: tuple[str, ...]
    seconds: int = 120
    marks: tuple = ()


#: bench module → its smoke run. Benches run elsewhere in the suite are in ``ELSEWHERE``.
SMOKE: dict[str, Smoke] = {
    "bench.join_overhead": Smoke(("--smoke",), (
        rf"baseline \(no-op activities\):\s+{NUMBER} s",
        rf"NodeJoin \(sim, 0 latency\):\s+{NUMBER} s",
        rf"ratio NodeJoin / baseline, wall:\s+{NUMBER}",
        rf"ratio NodeJoin / baseline, CPU:\s+{NUMBER}",
    )),
    "bench.fallback": Smoke(("--smoke",), (
        # The premise: four NoCapacity answers, then the join at the fifth site.
        r"attempts \(last round\):\s+site-0:NoCapacity → site-1:NoCapacity → site-2:NoCapacity → "
        r"site-3:NoCapacity → site-4:joined",
        rf"ratio fallback / direct:\s+{NUMBER}",
        rf"ms added per skipped offer:\s+{NUMBER} ms",
        rf"provider calls to a revoked account during a request \+ a catalog refresh: {NUMBER}",
    )),
    "bench.replicate": Smoke(("--smoke",), (
        rf"replicate \(verify\)\s+:\s+{NUMBER} s .* MiB/s",
        rf"throughput ratio vs same-config baseline\s*: {NUMBER} of medians",
    )),
    "bench.front_door": Smoke(("--smoke",), (
        rf"time to first token, p50 of 10 paired rounds: direct {NUMBER} ms, front door {NUMBER} ms; ratio {NUMBER}",
        rf"site killed: .* {NUMBER} new requests in the 2 s after it: {NUMBER}% served elsewhere",
    ), marks=(needs("haproxy"),)),
    "bench.demand": Smoke(("--smoke",), (
        rf"planning 1,000 pods / 10 sites / 40 offers: p50 {NUMBER} ms .*; 100 pods: p50 {NUMBER} ms",
        r"per pod, 1,000 pods / 100 pods: ratio [0-9.]+  \[target <= 3: (met|NOT met)\]",
        rf"\$/GPU-hour vs brute-force optimum on {NUMBER} small instances: mean \+{NUMBER}%",
        rf"round 0: pod bound in {NUMBER}s \(window {NUMBER}s\), direct NodeJoin {NUMBER}s",
        rf"vs a direct NodeJoin: median ratio {NUMBER}",
    ), seconds=180),
    "bench.scale": Smoke(("--smoke",), (
        r"\[2 nodes: joined 2 in .* faults contained\]",
        r"\[4 nodes: joined 2 in .* faults contained\]",
        rf"faults contained / late \(> 30 s\) / never\s+{NUMBER}/{NUMBER}/{NUMBER}\s+{NUMBER}/{NUMBER}/{NUMBER}",
        rf"capacity request -> result \(s\)\s+{NUMBER}",
        rf"incident: third fault -> routing weight 0 \(ms\)\s+{NUMBER}",
        r"target fault -> contained p99 at 4 within 5x of at 2: (met|NOT met) \([0-9.]+x",
        r"target report -> contained p99 at 4 within 5x of at 2: (met|NOT met) \([0-9.]+x",
        r"target worker cost per node within 1.5x of the first size: (met|NOT met)",
    ), seconds=300),
    # Benches whose code other work owns: run at a small size through their own options.
    "bench.incident": Smoke(("--drills", "1"), (
        rf"signal round-trip \(baseline\)\s+{NUMBER} ms",
        rf"threshold crossed -> routing weight 0\s+{NUMBER} ms\s+ratio {NUMBER}x",
        rf"threshold crossed -> capacity requested\s+{NUMBER} ms\s+ratio {NUMBER}x",
        r"targets p50 ratio <= 10x \(weight 0\) and <= 13x \(capacity\): (met|NOT met)",
    )),
    "bench.repair_latency": Smoke(("--faults", "2", "--nodes", "2"), (
        rf"signal round-trip \(query sees it\)\s+{NUMBER} ms",
        rf"fault report -> contained\s+{NUMBER} ms",
        rf"ratio contained / signal->activity \(p50\): {NUMBER}",
        rf"ratio contained / signal->activity \(p99\): {NUMBER}",
        r"target both <= 4: (met|NOT met)",
    )),
    "bench.gateway": Smoke(("--samples", "20", "--flood-rounds", "1", "--flood-batch", "5", "--flood-polls", "100",
                            "--flood-big", "2", "--idle", "10", "--window", "5", "--faults", "2", "--nodes", "2"), (
        rf"round trip through the gateway / through the pass-through proxy, p50, worst run: {NUMBER} "
        rf"\(target <= 1.15: (met|NOT met)\)",
        rf"round trip through the gateway / direct, p50, worst run: {NUMBER}",
        rf"gateway adds per hop \(half the round trip's difference from direct\), worst run: p50 -?{NUMBER} ms, "
        rf"p99 -?{NUMBER} ms",
        # The flood's premise: the attacker held at the gateway's bound, every victim round trip counted.
        r"round trips done: quiet 5 of 5, attacked 5 of 5",
        rf"ratio attacked / quiet p99: {NUMBER} \(target <= 1.2, every round trip done: (met|NOT met)\)",
        r"gateway held 32 of the attacker's calls over its limits",
        rf"steady mix: 10 idle nodes through the gateway .* 5 s window",
        rf"gateway CPU: {NUMBER} s in 5 s = {NUMBER} core at 10 nodes; per 1,000 nodes: {NUMBER} core "
        rf"\(target <= 0.15: (met|NOT met)\)",
        rf"fault reported -> contained, 2 faults on 2 nodes behind the gateway",
        rf"gateway resident memory with 10 idle nodes held: {NUMBER} MB",
    ), seconds=180),
    "bench.slot_queue": Smoke(("--smoke",), (
        r"one 8-GPU node, Q repairs queued for its action slot",
        rf"node_action_wait at Q=4: before {NUMBER}, now {NUMBER}; ratio now / 2Q-3: {NUMBER}",
    )),
}

#: Benches whose smoke run is another test of the suite (module → that test).
ELSEWHERE = {
    "bench.actions": "tests/test_bench_actions.py::test_smoke_run_prints_every_figure",
    "bench.soak": "tests/test_soak.py::test_short_chaos_soak_keeps_every_invariant",
}

#: Programs in bench/ that are a bench's process rather than a bench (module → the bench that
#: runs it, whose smoke run runs it too).
PROCESSES = {"bench.flood_attacker": "bench.gateway", "bench.passthrough": "bench.gateway"}


def runnable_benches() -> set[str]:
    """Every module in bench/ that runs as a program (``if __name__ == "__main__":``); the rest
    (common, baseline, echo) are the benches' parts, and so are ``PROCESSES``."""
    found = set()
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
            found.add(f"bench.{path.stem}")
    return found


def test_every_bench_has_a_smoke_run_in_the_suite() -> None:
    benches = runnable_benches()
    assert {"bench.join_overhead", "bench.scale"} <= benches, benches  # the finder finds
    assert all(SMOKE.get(bench) for bench in PROCESSES.values()), PROCESSES
    missing = benches - set(SMOKE) - set(ELSEWHERE) - set(PROCESSES)
    assert not missing, f"benches without a smoke run in the suite (add one to tests/test_bench_smoke.py): {missing}"
    for module, test in ELSEWHERE.items():
        path, _, name = test.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text() or f"async def {name}(" in (ROOT / path).read_text(), \
            f"{module}'s smoke run {test} is gone"
    assert not set(SMOKE) - benches, f"smoke runs of benches that no longer exist: {set(SMOKE) - benches}"


def smoke_params():
    return [pytest.param(module, smoke, id=module.removeprefix("bench."),
                         marks=(*smoke.marks, pytest.mark.timeout(smoke.seconds + 30)))
            for module, smoke in SMOKE.items()]


@pytest.mark.integration  # each run is a process, most with a dev server of their own
@pytest.mark.parametrize(("module", "smoke"), smoke_params())
def test_the_bench_runs_at_its_smoke_size_and_prints_its_figures(module: str, smoke: Smoke) -> None:
    done = subprocess.run([sys.executable, "-m", module, *smoke.args], cwd=ROOT, capture_output=True, text=True,
                          timeout=smoke.seconds)
    out = done.stdout
    assert done.returncode == 0, f"{module} {' '.join(smoke.args)} exited {done.returncode}:\n{out[-3000:]}\n" \
                                 f"{done.stderr[-4000:]}"
    for figure in smoke.figures:
        assert re.search(figure, out), f"{module} no longer prints /{figure}/:\n{out[-3000:]}"
