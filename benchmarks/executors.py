"""What does Ray cost per point against local processes, for the simulator's grids, here?

    .venv/bin/python benchmarks/executors.py            # ~40 min on 2 busy cores
    .venv/bin/python benchmarks/executors.py --smoke    # ~2 min: checks the pipeline

Two grids, each command run in a fresh process and timed around it:

- replay: ``growpage sim replay --synthetic 16 --gen-len 8192 --signals`` (docs/results.md,
  section 2): 16 points, one per trace;
- sweep: ``growpage sim sweep --workload mixed --fidelity-traces 1`` over the 48 points of
  ``SWEEP_POINTS`` (the mixed workload of docs/results.md, section 3).

Each grid runs with ``--jobs 2`` (two local processes) and with ``--executor ray --address A``,
joining a Ray of 2 CPUs that this script starts first (its start-up is timed apart: a cluster
is started once and serves many commands), one after the other (the replay twice each, in
turns). The replay also runs with ``--executor ray`` alone, which starts and stops a Ray of its
own: what a single command on one machine pays.

The machine is shared, and its load moves the points' own times by tens of percent from one
run to the next, more than Ray costs. So every run is measured against itself: its points'
seconds, ``busy_s`` (each measured where it ran, from ``--out``'s finished points), over the 2
workers, leave ``idle_s = wall - process start - busy_s / 2``: start-up, scheduling, moving
arguments and rows, and the tail where one worker waits for the other. Ray's overhead per
point is ``(idle with Ray - idle local) / points``; its share is that over the local wall time.
A point's own time, ``point_s``, is the local ``busy_s`` over the points. The rows of every run
of a grid must be identical (the script fails otherwise). Writes ``<out>/executors.json``
(default ``results/executors``).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from script_args import add_out, parser, run_main

from growpage.core.traces import atomic_write
from growpage.eval.machine import describe_machine
from growpage.executors.options import FINISHED_DIR

GROWPAGE = Path(sys.executable).parent / "growpage"
JOBS = 2
STARTUP = [0.0]  # seconds of a fresh process's imports (startup_s), measured first
REPS = {"replay": 2, "sweep": 1}  # runs of each kind, in turns

SWEEP_POINTS = [  # 12 + 4 + 8 + 16 + 8 = 48 points
    "growpage@tau=-0.01,0,0.01,0.02;p=0.95,0.99,0.999",
    "inverse@tau=-0.01,0,0.01,0.02",
    "random@grow_prob=0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8",
    "fixed@budget_tokens=" + ",".join(str(512 * k) for k in range(1, 17)),
    "shrink@tau=-0.01,0,0.01,0.02;min_capacity_tokens=512,1024",
]
GRIDS = {
    "replay": (
        ["sim", "replay", "--synthetic", "16", "--gen-len", "8192", "--signals"],
        16,
    ),
    "sweep": (
        [
            "sim",
            "sweep",
            "--workload",
            "mixed",
            "--fidelity-traces",
            "1",
            "--points",
            *SWEEP_POINTS,
        ],
        48,
    ),
}
SMOKE = {
    "replay": (["sim", "replay", "--synthetic", "4", "--gen-len", "512", "--signals"], 4),
    "sweep": (
        ["sim", "sweep", "--workload", "tiny", "--page-size", "64", "--kv-pages", "150"]
        + ["--fidelity-traces", "1", "--points", "fixed@budget_tokens=128,256,384,512"],
        4,
    ),
}


def timed(argv: list[str], out: Path) -> dict:
    """``growpage ARGV --json --out OUT`` in a fresh process: its wall seconds, the seconds
    of its points (``busy_s``) and its JSON (``rows``)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [str(GROWPAGE), *argv, "--json", "--out", str(out)], capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"growpage {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    finished = [json.loads(p.read_text()) for p in (out / FINISHED_DIR).glob("*.json")]
    busy = sum(f["point_s"] for f in finished)
    return {"wall_s": wall, "busy_s": busy, "rows": json.loads(proc.stdout)}


def startup_s() -> float:
    """Seconds a fresh ``growpage`` process takes to import what a grid command imports (part
    of every timed command, not of its points)."""
    start = time.perf_counter()
    code = "import growpage.cli, growpage.commands.sim, growpage.executors.grids"
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def start_ray() -> tuple[str, float]:
    """A Ray of ``JOBS`` CPUs for the commands to join: its address and start-up seconds."""
    import ray

    start = time.perf_counter()
    ray.init(num_cpus=JOBS, address="local", include_dashboard=False, logging_level=logging.WARNING)
    return ray.get_runtime_context().gcs_address, time.perf_counter() - start


def measure(
    name: str, argv: list[str], points: int, address: str, reps: int, cold: bool, work: Path
) -> dict:
    """Local and Ray runs of one grid, in turns; see the module docstring."""
    kinds = {"local": ["--jobs", str(JOBS)], "ray": ["--executor", "ray", "--address", address]}
    if cold:
        kinds["ray_cold"] = ["--executor", "ray", "--jobs", str(JOBS)]
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for rep in range(reps):
        for kind, flags in kinds.items():
            print(f"[executors] {name}, {kind}, run {rep + 1} ...", flush=True)
            run = timed([*argv, *flags], work / f"{name}-{kind}-{rep}")
            print(f"[executors] {name}, {kind}: {run['wall_s']:.1f} s", flush=True)
            runs[kind].append(run)
    local_rows = runs["local"][0]["rows"]
    if any(r["rows"] != local_rows for rs in runs.values() for r in rs):
        raise SystemExit(f"{name}: the rows of the runs differ")
    return summary(argv, points, runs)


def summary(argv: list[str], points: int, runs: dict[str, list[dict]]) -> dict:
    """Per kind of run: wall, busy and idle seconds (each run, and their median)."""
    out: dict = {"command": "growpage " + " ".join(argv), "points": points}
    idle: dict[str, float] = {}
    for kind, rs in runs.items():
        walls = [r["wall_s"] for r in rs]
        idles = [r["wall_s"] - STARTUP[0] - r["busy_s"] / JOBS for r in rs]
        idle[kind] = statistics.median(idles)
        out[kind] = {
            "wall_s": walls,
            "busy_s": [r["busy_s"] for r in rs],
            "idle_s": idles,
        }
    local_wall = statistics.median(out["local"]["wall_s"])
    out["point_s"] = statistics.median(out["local"]["busy_s"]) / points
    for kind in runs:
        if kind != "local":
            extra = idle[kind] - idle["local"]
            out[f"{kind}_overhead_per_point_s"] = extra / points
            out[f"{kind}_overhead_share"] = extra / local_wall
    out["rows_identical"] = True
    return out


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny grids: checks the pipeline")
    add_out(p, "executors")
    args = p.parse_args(argv)
    import ray

    machine, measured = describe_machine(), commit()  # the code the commands run
    STARTUP[0] = min(startup_s() for _ in range(2))
    address, start_s = start_ray()
    print(f"[executors] Ray of {JOBS} CPUs at {address}, started in {start_s:.1f} s", flush=True)
    try:
        with tempfile.TemporaryDirectory() as work:
            grids = {
                name: measure(
                    name,
                    grid_argv,
                    points,
                    address,
                    1 if args.smoke else REPS[name],
                    name == "replay",
                    Path(work),
                )
                for name, (grid_argv, points) in (SMOKE if args.smoke else GRIDS).items()
            }
    finally:
        stop = time.perf_counter()
        ray.shutdown()
        stop_s = time.perf_counter() - stop
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": measured,
        "command": "python benchmarks/executors.py" + (" --smoke" if args.smoke else ""),
        "machine": f"{machine}, load average {os.getloadavg()[0]:.1f} at the end",
        "ray_version": ray.__version__,
        "jobs": JOBS,
        "process_start_s": STARTUP[0],
        "ray_start_s": start_s,
        "ray_stop_s": stop_s,
        "grids": grids,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("executors-smoke.json" if args.smoke else "executors.json")
    text = json.dumps(report, indent=1) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    for name, g in grids.items():
        cold = (
            f"; a Ray of its own {g['ray_cold_overhead_per_point_s']:+.2f} s per point "
            f"({g['ray_cold_overhead_share']:+.1%})"
            if "ray_cold_overhead_per_point_s" in g
            else ""
        )
        print(
            f"{name}: {g['points']} points of ~{g['point_s']:.1f} s; Ray over local --jobs "
            f"{JOBS}: {g['ray_overhead_per_point_s']:+.2f} s per point "
            f"({g['ray_overhead_share']:+.1%}){cold}; rows identical"
        )
    print(f"Ray start {start_s:.1f} s, stop {stop_s:.1f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
