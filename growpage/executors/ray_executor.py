"""The Ray executor: the points as Ray tasks (or on Ray actors) of a local or remote cluster.

Ray is an optional extra (``pip install 'growpage[ray]'``), imported only when this executor
starts. ``address``: a cluster to join (``ray start --head`` prints it; ``auto`` finds one
started on this machine); None joins ``RAY_ADDRESS`` when it is set, else starts a local Ray
for this run (stopped by ``close``). A Ray that this process already runs (``ray.init``
called before) is used as it is and left running.

Each point is a task of ``num_cpus`` CPUs (and ``num_gpus`` GPUs) that Ray runs again, up to
``max_retries`` times, when its worker dies; the grid's shared argument goes once into Ray's
object store, not once per point. With ``actors``, the points run on a fixed set of Ray actors
instead, one per ``num_gpus`` GPUs of the cluster (or ``num_cpus`` CPUs when no GPU is asked
for), each a process that lives until ``close``: a point function that keeps an engine per
process builds it once per actor, on the actor's own GPU. Ray restarts a dead actor and runs
its point again (``max_retries`` times).
"""

from __future__ import annotations

import logging
import os
import socket
from collections import deque
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from growpage.errors import ConfigError, describe_error
from growpage.executors.base import (
    Completion,
    Executor,
    PointFn,
    Task,
    died_row,
    timed_point,
)
from growpage.executors.store import Row

RAY_MISSING = "--executor ray needs Ray, an optional extra: pip install 'growpage[ray]'"


def import_ray() -> ModuleType:
    """The ``ray`` module, or a ``ConfigError`` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"{RAY_MISSING} ({e})") from None
    return ray


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A ``ConfigError`` at once when ``host:port`` does not answer (Ray itself would retry
    for minutes); other forms (``local``, ``auto``, ``ray://...``) are left to Ray."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"--address {address}: no Ray cluster answers there ({e.strerror or e}); start one "
            "with `ray start --head`, or leave --address out to start a local Ray"
        ) from None


class PointWorker:
    """A Ray actor's body: runs points in one long-lived process (see ``actors``)."""

    def run(self, fn: PointFn, item: Any, shared: Any, identity: Row) -> tuple[Row, float]:
        return timed_point(fn, item, shared, identity)

    def pid(self) -> int:
        return os.getpid()


class RayExecutor(Executor):
    """See the module docstring. ``local_cpus``: CPUs of a Ray this executor starts itself
    (None: all of this machine's); ``workers``: how many actors (default: as many as fit)."""

    kind = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        actors: bool = False,
        workers: int | None = None,
        local_cpus: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if num_cpus < 0 or num_gpus < 0 or (workers is not None and workers < 1):
            raise ConfigError(
                f"RayExecutor: num_cpus and num_gpus must be >= 0 and workers >= 1, got "
                f"{num_cpus}, {num_gpus}, {workers}"
            )
        self.address, self.local_cpus = address, local_cpus
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.actors, self.workers = actors, workers
        self.ray = import_ray()
        self._started = False
        self._remote: Any = None
        self._actor_class: Any = None
        self._pool: list[Any] = []  # live actors
        self._running: dict[Any, Any] = {}  # object ref -> actor, or None for a task

    def _connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        address = self.address or os.environ.get("RAY_ADDRESS") or "local"
        check_reachable(address)
        options: dict[str, Any] = {"address": address, "logging_level": logging.WARNING}
        if address == "local":
            options.update(include_dashboard=False, num_cpus=self.local_cpus)
        try:
            ray.init(**options)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ConfigError(f"--address {address}: cannot join the Ray cluster ({e})") from None
        self._started = True

    def _completions(self, fn: PointFn, tasks: list[Task], shared: Any) -> Iterator[Completion]:
        if not tasks:
            return
        self._connect()
        ray = self.ray
        fn_ref, shared_ref = ray.put(fn), ray.put(shared)
        if self.actors:
            yield from self._on_actors(fn_ref, shared_ref, tasks)
            return
        if self._remote is None:
            self._remote = ray.remote(timed_point).options(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_retries=self.max_retries
            )
        refs = {self._remote.remote(fn_ref, t.item, shared_ref, t.identity): t for t in tasks}
        self._running = dict.fromkeys(refs)
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            for ref in done:
                t = refs.pop(ref)
                self._running.pop(ref, None)
                row, seconds, _ = self._row(ref, t)
                yield t.index, row, seconds

    def _row(self, ref: Any, t: Task) -> tuple[Row, float | None, bool]:
        """The point's row, its seconds, and whether its worker died (past its retries)."""
        errors = self.ray.exceptions
        try:
            row, seconds = self.ray.get(ref)
        except (errors.RayActorError, errors.WorkerCrashedError, errors.NodeDiedError) as e:
            return died_row(t.identity, self.max_retries + 1, type(e).__name__), None, True
        except errors.RayError as e:
            return {**t.identity, "error": describe_error(e)}, None, False
        return row, seconds, False

    def _new_actor(self) -> Any:
        if self._actor_class is None:
            self._actor_class = self.ray.remote(PointWorker).options(
                num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                max_restarts=self.max_retries,
                max_task_retries=self.max_retries,
            )
        return self._actor_class.remote()

    def _num_actors(self, num_tasks: int) -> int:
        if self.workers is not None:
            return min(self.workers, num_tasks)
        resources = self.ray.cluster_resources()
        if self.num_gpus:
            fit = int(resources.get("GPU", 0) // self.num_gpus)
            if not fit:
                raise ConfigError(
                    f"the Ray cluster has no GPU for a worker of {self.num_gpus} GPU(s) "
                    f"(resources: {resources})"
                )
        else:
            fit = int(resources.get("CPU", 1) // max(self.num_cpus, 1e-9))
        return max(1, min(fit, num_tasks))

    def _on_actors(self, fn_ref: Any, shared_ref: Any, tasks: list[Task]) -> Iterator[Completion]:
        ray = self.ray
        while len(self._pool) < self._num_actors(len(tasks)):
            self._pool.append(self._new_actor())
        idle, queue = deque(self._pool), deque(tasks)
        running: dict[Any, tuple[Any, Task]] = {}
        while queue or running:
            while queue and idle:
                actor, t = idle.popleft(), queue.popleft()
                ref = actor.run.remote(fn_ref, t.item, shared_ref, t.identity)
                running[ref], self._running[ref] = (actor, t), actor
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                actor, t = running.pop(ref)
                self._running.pop(ref, None)
                row, seconds, died = self._row(ref, t)
                if died:  # past its restarts: a new actor takes its place
                    self._pool.remove(actor)
                    actor = self._new_actor()
                    self._pool.append(actor)
                idle.append(actor)
                yield t.index, row, seconds

    def worker_pids(self) -> list[int]:
        """The process ids of the live actors (``actors`` only)."""
        return list(self.ray.get([a.pid.remote() for a in self._pool]))

    def _interrupt(self) -> None:
        killed = []
        for ref, actor in self._running.items():
            try:
                if actor is None:
                    self.ray.cancel(ref, force=True)
                else:
                    self.ray.kill(actor, no_restart=True)
                    killed.append(actor)
            except Exception:  # noqa: BLE001 - stopping what is left; it may be gone already
                continue
        self._running = {}
        self._pool = [a for a in self._pool if all(a is not k for k in killed)]

    def close(self) -> None:
        for actor in self._pool:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - the actor may be gone already
                continue
        self._pool = []
        if self._started:
            self.ray.shutdown()
            self._started = False
