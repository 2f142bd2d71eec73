"""``EngineLoop``: the one thread that owns the engine; HTTP handlers talk to it by queues.

::

    handlers (asyncio) --submit / abort--> commands (queue.SimpleQueue) --> engine thread
    handlers <-- Accepted, StreamChunk, ServerError (one sink per request) <-- engine thread

The engine is not thread-safe, so only this thread touches it. Between two steps it takes
every waiting command (adds, aborts), steps once (continuous batching across all clients),
publishes an ``EngineSnapshot`` for ``/metrics``, and hands each request the text it produced
(``LLM.stream_chunk``); with nothing to run it sleeps on the command queue.

Faults stay local: a request the engine refuses gets a 400, a full queue a 429, and a policy
error at one request's capacity boundary fails that request alone with a 500 (the engine
leaves the others as they were, and the aborted request's pages go back). Any other error in a
step fails the requests in flight and keeps the loop alive.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from growpage.engine.llm import StreamProgress
from growpage.engine.loop.sequence import Sequence
from growpage.engine.outputs import StreamChunk
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError, PolicyError
from growpage.server.metrics import EngineSnapshot, ServerMetrics
from growpage.server.protocol import ServerError, internal_error

if TYPE_CHECKING:
    from growpage.engine.llm import LLM

logger = logging.getLogger("growpage.server")
STATS_RESET_STEPS = 10_000  # EngineStats keeps per-step rows: dropped this often (and when idle)


@attrs.frozen
class EngineRequest:
    """A request for the engine thread: tokens, params, and its arrival at the server
    (``time.perf_counter()`` seconds, what TTFT counts from). ``prompt_param``: the body's
    field that held the prompt, named by an error the engine finds in it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_s: float
    prompt_param: str = "prompt"


@attrs.frozen
class Accepted:
    """The engine queued the request."""

    num_prompt_tokens: int


Event = Accepted | StreamChunk | ServerError
Sink = Callable[[Event], None]


@attrs.define
class _Active:
    seq: Sequence
    progress: StreamProgress
    sink: Sink
    num_counted: int = 0  # output tokens already added to the generation counter


def shutting_down() -> ServerError:
    return ServerError(
        503, "the server is shutting down", type="server_error", code="shutting_down"
    )


class EngineLoop:
    """Runs ``llm.engine`` on a thread of its own (``start`` / ``stop``).

    ``max_waiting``: most requests queued for admission; one more gets a 429 (None: no limit).
    """

    def __init__(
        self, llm: LLM, max_waiting: int | None = None, metrics: ServerMetrics | None = None
    ) -> None:
        self.llm, self.engine = llm, llm.engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.snapshot = EngineSnapshot()  # replaced (never changed) by the engine thread
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._lock = threading.Lock()  # guards _closed against submit racing the shutdown
        self._closed = False  # the thread takes no more commands
        self._stopping = False
        self._deadline: float | None = None  # drain: abort what still runs after this time
        self._finished: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._thread = threading.Thread(target=self._run, name="growpage-engine", daemon=True)

    # ---- the handlers' side ---------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, request: EngineRequest, sink: Sink) -> None:
        """Queue ``request``; ``sink`` gets ``Accepted`` or a ``ServerError``, then its chunks
        (the last with ``output`` set). ``sink`` is called on the engine thread."""
        with self._lock:
            if not self._closed:
                self._commands.put(("add", request, sink))
                return
        sink(shutting_down())

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` (its client went away); no more events come for it."""
        self._commands.put(("abort", request_id))

    def drain(self, timeout_s: float) -> None:
        """Let the requests in flight run on for ``timeout_s`` seconds, then abort those still
        running (each gets its last chunk, finish reason ``abort``). Safe in a signal
        handler."""
        self._commands.put(("drain", time.perf_counter() + timeout_s))

    def stop(self, timeout_s: float | None = None) -> None:
        """Abort what is in flight (each gets its last chunk, finish reason ``abort``) and end
        the thread; waits for it up to ``timeout_s``."""
        self._commands.put(("stop",))
        self._thread.join(timeout_s)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._take_commands(block=not self.engine.has_unfinished())
                if self._stopping:
                    break
                if self.engine.has_unfinished():
                    self._step()
                if self._deadline is not None and time.perf_counter() >= self._deadline:
                    self.engine.abort_all()  # their last chunks say "abort"
                self._emit()
                stats = self.engine.stats
                if not self.engine.has_unfinished() or stats.num_steps >= STATS_RESET_STEPS:
                    stats.reset()
        except BaseException:
            logger.exception("the engine loop stopped on an error")
            raise
        finally:
            self._shut_down()

    def _take_commands(self, block: bool) -> None:
        """Handle every queued command (waiting for one first when ``block``)."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            kind = command[0]
            if kind == "add":
                self._add(command[1], command[2])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "drain":
                self._deadline = command[1]
            else:
                self._stopping = True
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: EngineRequest, sink: Sink) -> None:
        if self._stopping:
            self._reject(sink, "shutting_down", shutting_down())
            return
        if request.request_id in self._active:
            error = ServerError(400, f"request id {request.request_id!r} is already in use")
            self._reject(sink, "invalid", error)
            return
        num_waiting = len(self.engine.scheduler.waiting)
        if self.max_waiting is not None and num_waiting >= self.max_waiting:
            error = ServerError(
                429,
                f"the server's queue is full ({num_waiting} requests waiting); retry later",
                type="rate_limit_error",
                code="queue_full",
            )
            self._reject(sink, "queue_full", error)
            return
        try:
            seq = self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                prompt=request.prompt,
                arrival_s=request.arrival_s,
            )
        except EngineError as exc:  # cannot fit the KV pool, a token id out of range...
            self._reject(sink, "invalid", ServerError(400, str(exc), param=request.prompt_param))
            return
        self._active[request.request_id] = _Active(seq, StreamProgress(), sink)
        self._num_prompt_tokens += len(request.prompt_token_ids)
        sink(Accepted(len(request.prompt_token_ids)))

    def _reject(self, sink: Sink, reason: str, error: ServerError) -> None:
        self._rejected[reason] += 1
        sink(error)

    def _abort(self, request_id: str) -> None:
        active = self._active.pop(request_id, None)
        if active is not None:
            self.engine.abort(request_id)
            self._count_tokens(active)
            self._finished["abort"] += 1

    def _step(self) -> None:
        start, boundary = time.perf_counter(), self.engine.kv.boundary_s
        try:
            self.engine.step()
        except PolicyError as exc:
            if exc.request_id not in self._active:
                self._fail_all(exc)
            else:  # the engine left the others as they were: fail this one alone
                logger.error("request %s failed: %s", exc.request_id, exc, exc_info=exc)
                self._fail(exc.request_id, internal_error(f"the request failed: {exc}"))
        except Exception as exc:  # noqa: BLE001 - the loop outlives a failed step
            self._fail_all(exc)
        if self.metrics is not None:
            self.metrics.observe_step(
                time.perf_counter() - start, self.engine.kv.boundary_s - boundary
            )

    def _fail(self, request_id: str, error: ServerError) -> None:
        active = self._active.pop(request_id)
        self.engine.abort(request_id)
        self._count_tokens(active)
        self._finished["error"] += 1
        active.sink(error)

    def _fail_all(self, exc: Exception) -> None:
        logger.error("an engine step failed: %s", exc, exc_info=exc)
        for request_id in list(self._active):
            self._fail(request_id, internal_error(f"the engine step failed: {exc}"))
        self.engine.abort_all()

    def _emit(self) -> None:
        """Each request's new text (a finished request's last chunk ends its stream), after a
        fresh snapshot: what a client has been sent, ``/metrics`` already counts."""
        outbox: list[tuple[_Active, StreamChunk]] = []
        for request_id, active in list(self._active.items()):
            chunk = self.llm.stream_chunk(0, active.seq, active.progress)
            if chunk is None:
                continue
            self._count_tokens(active)
            if chunk.output is not None:
                del self._active[request_id]
                self._finished[chunk.output.finish_reason] += 1
                if self.metrics is not None:
                    self.metrics.observe_finished(active.seq)
            outbox.append((active, chunk))
        self._publish()
        for active, chunk in outbox:
            active.sink(chunk)

    def _count_tokens(self, active: _Active) -> None:
        self._num_generation_tokens += active.seq.num_output_tokens - active.num_counted
        active.num_counted = active.seq.num_output_tokens

    def _publish(self) -> None:
        """A fresh snapshot of the engine's numbers for ``/metrics``."""
        engine, kv = self.engine, self.engine.kv
        self.snapshot = EngineSnapshot(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_pages_used=kv.pool.num_used_pages,
            num_pages_free=kv.pool.num_free_pages,
            events=kv.controller.events.as_dict(),
            num_preemptions=engine.scheduler.num_preemptions,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            boundary_s=kv.boundary_s,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            finished=dict(self._finished),
            rejected=dict(self._rejected),
        )

    def _shut_down(self) -> None:
        """Abort what is in flight (each request gets its last chunk, finish reason
        ``abort``) and refuse the commands still queued."""
        self._stopping = True
        with self._lock:
            self._closed = True
        self.engine.abort_all()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._reject(command[2], "shutting_down", shutting_down())
        self._emit()
