"""Ray against local processes for the simulator's grids, side by side on this machine.

    .venv/bin/python benchmarks/executors.py            # ~30 min on 2 busy cores
    .venv/bin/python benchmarks/executors.py --smoke    # ~1 min: checks the pipeline

Two grids, each command run in a fresh process and timed around it:

- replay: ``growpage sim replay --synthetic 16 --gen-len 8192 --signals`` (docs/results.md,
  section 2): 16 points, one per trace;
- sweep: ``growpage sim sweep --workload mixed --fidelity-traces 1`` over the 48 points of
  ``SWEEP_POINTS`` (the mixed workload of docs/results.md, section 3).

Each grid runs with ``--jobs 2`` (two local processes) and with ``--executor ray --address A``,
joining a Ray of 2 CPUs that this script starts first (its start-up is timed apart: a cluster
is started once and serves many commands). The replay also runs with ``--executor ray`` alone,
which starts and stops a Ray of its own: what a single command on one machine pays.

Ray's overhead per point is ``(wall with Ray - wall local) / points``, and its share is that
difference over the local wall time. A point's own time, ``per_point_s``, is the local wall time
less a process's start-up (``process_start_s``: imports), times ``--jobs``, over the points. The rows of the runs of a grid must be identical (the
script fails otherwise). Writes ``<out>/executors.json`` (default ``results/executors``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from growpage.core.traces import atomic_write
from growpage.eval.machine import describe_machine

ROOT = Path(__file__).resolve().parents[1]
GROWPAGE = Path(sys.executable).parent / "growpage"
JOBS = 2

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


def timed(argv: list[str]) -> tuple[float, dict]:
    """Wall seconds of ``growpage ARGV --json`` in a fresh process, and its JSON."""
    start = time.perf_counter()
    proc = subprocess.run([str(GROWPAGE), *argv, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"growpage {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return wall, json.loads(proc.stdout)


def startup_s() -> float:
    """Seconds a fresh ``growpage`` process takes to import what a grid command imports (part
    of every timed command, not of its points)."""
    start = time.perf_counter()
    code = "import growpage.cli, growpage.sim.commands, growpage.executors.grids"
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def start_ray() -> tuple[str, float]:
    """A Ray of ``JOBS`` CPUs for the commands to join: its address and start-up seconds."""
    import ray

    start = time.perf_counter()
    ray.init(num_cpus=JOBS, address="local", include_dashboard=False, logging_level=logging.WARNING)
    return ray.get_runtime_context().gcs_address, time.perf_counter() - start


def measure(
    name: str, argv: list[str], points: int, address: str, cold: bool, startup: float
) -> dict:
    print(f"[executors] {name}: local, --jobs {JOBS} ...", flush=True)
    local_s, local = timed([*argv, "--jobs", str(JOBS)])
    print(f"[executors] {name}: local {local_s:.1f} s; Ray (joined) ...", flush=True)
    ray_s, joined = timed([*argv, "--executor", "ray", "--address", address])
    print(f"[executors] {name}: Ray (joined) {ray_s:.1f} s", flush=True)
    result = {
        "command": "growpage " + " ".join(argv),
        "points": points,
        "local_s": local_s,
        "ray_joined_s": ray_s,
        "per_point_s": (local_s - startup) * JOBS / points,
        "ray_overhead_per_point_s": (ray_s - local_s) / points,
        "ray_overhead_share": (ray_s - local_s) / local_s,
        "rows_identical": joined == local,
    }
    if cold:
        print(f"[executors] {name}: Ray (started by the command) ...", flush=True)
        cold_s, alone = timed([*argv, "--executor", "ray", "--jobs", str(JOBS)])
        result.update(
            ray_cold_s=cold_s,
            ray_cold_overhead_per_point_s=(cold_s - local_s) / points,
            ray_cold_overhead_share=(cold_s - local_s) / local_s,
            rows_identical=result["rows_identical"] and alone == local,
        )
    if not result["rows_identical"]:
        raise SystemExit(f"{name}: the Ray rows differ from the local ones")
    return result


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny grids: checks the pipeline")
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "results" / "executors",
        help="folder of executors.json (default: results/executors)",
    )
    args = p.parse_args(argv)
    import ray

    machine, measured = describe_machine(), commit()  # the code the commands run
    startup = min(startup_s() for _ in range(2))
    address, start_s = start_ray()
    print(f"[executors] Ray of {JOBS} CPUs at {address}, started in {start_s:.1f} s", flush=True)
    try:
        grids = {
            name: measure(name, grid_argv, points, address, name == "replay", startup)
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
        "process_start_s": startup,
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
            f"; started by the command {g['ray_cold_s']:.1f} s "
            f"({g['ray_cold_overhead_per_point_s']:+.2f} s per point)"
            if "ray_cold_s" in g
            else ""
        )
        print(
            f"{name}: {g['points']} points of ~{g['per_point_s']:.1f} s; local --jobs {JOBS} "
            f"{g['local_s']:.1f} s, Ray {g['ray_joined_s']:.1f} s: "
            f"{g['ray_overhead_per_point_s']:+.2f} s per point "
            f"({g['ray_overhead_share']:+.1%}){cold}; rows identical"
        )
    print(f"Ray start {start_s:.1f} s, stop {stop_s:.1f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
