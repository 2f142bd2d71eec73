"""The command-line face of the executors: one set of flags for every grid, and the executor
they ask for.

    --executor local|ray   where the points run (default local: no Ray needed)
    --address ADDR         ray: the cluster to join (default: RAY_ADDRESS, else a local Ray)
    --jobs N               local: worker processes; ray: CPUs of a Ray it starts (default all)
    --resume               skip the points whose rows an earlier run left in --out
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from growpage.errors import ConfigError
from growpage.executors.base import Executor
from growpage.executors.store import RowStore
from growpage.validators import at_least

FINISHED_DIR = "finished-points"  # under --out: one file per finished point (RowStore)


def add_executor_arguments(p: argparse.ArgumentParser, jobs: int, what: str = "points") -> None:
    """The executor flags; ``jobs``: the default of ``--jobs``."""
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help=f"where the {what} run: local processes (default) or a Ray cluster (needs "
        "pip install 'growpage[ray]')",
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="--executor ray: the Ray cluster to join, as `ray start --head` prints it, or "
        "auto (default: $RAY_ADDRESS when set, else a Ray started for this run)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"{what} run at once: local worker processes (default {jobs}; 1: in this "
        "process), or the CPUs of a Ray started for this run (default: every core)",
    )
    p.set_defaults(default_jobs=jobs)
    p.add_argument(
        "--resume",
        action="store_true",
        help=f"skip the {what} whose results an earlier run with the same settings left in "
        f"--out (each is kept in --out/{FINISHED_DIR}/ the moment it finishes)",
    )


def jobs_of(args: argparse.Namespace) -> int:
    """``--jobs``, its default filled in."""
    return int(args.default_jobs if args.jobs is None else args.jobs)


def make_executor(
    args: argparse.Namespace,
    out: Path | None,
    progress: bool = True,
    *,
    worker_env: list[dict[str, str]] | None = None,
    **ray_options: Any,
) -> Executor:
    """The executor of ``--executor``, ``--address``, ``--jobs`` and ``--resume``, its finished
    rows kept under ``out`` (None: not kept). ``worker_env`` goes to ``LocalExecutor`` (one
    GPU per worker), ``ray_options`` to ``RayExecutor`` (the resources of one point,
    ``actors``)."""
    jobs = jobs_of(args)
    at_least(1).require("--jobs", jobs)
    if args.resume and out is None:
        raise ConfigError("--resume needs --out DIR: the finished points are kept there")
    if args.executor == "local" and args.address is not None:
        raise ConfigError("--address: for --executor ray only")
    joins = args.address is not None or bool(os.environ.get("RAY_ADDRESS"))
    if args.executor == "ray" and joins and args.jobs is not None:
        raise ConfigError(
            "--jobs sizes a Ray started for this run; a cluster joined with --address or "
            "RAY_ADDRESS runs as many points at once as it has CPUs"
        )
    if args.executor == "ray":
        from growpage.executors.ray_executor import check_reachable, import_ray

        import_ray()  # missing: said now, before the stored rows of an earlier run go
        if joins:
            check_reachable(args.address or os.environ["RAY_ADDRESS"])
    # NOTE: last, once every flag is checked: without --resume it clears the stored rows.
    store = RowStore(out / FINISHED_DIR, resume=args.resume) if out is not None else None
    if args.executor == "local":
        from growpage.executors.local import LocalExecutor

        return LocalExecutor(jobs, worker_env=worker_env, store=store, progress=progress)
    from growpage.executors.ray_executor import RayExecutor

    return RayExecutor(
        args.address, local_cpus=args.jobs, store=store, progress=progress, **ray_options
    )
