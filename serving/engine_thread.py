"""EngineThread: the one thread that owns the engine; every front end talks to it.

The engine is any :class:`jbatch.engine.interface.EngineClient` (an ``LLMEngine``, or the
data-parallel router); it is not thread-safe, so nothing but this thread touches it, and only
through that interface. Data flow of a request:

1. A front end (gRPC or HTTP handler, on its asyncio loop) tokenizes the prompt, builds
   ``SamplingParams`` (a ``ValueError`` there is INVALID_ARGUMENT) and calls
   :meth:`EngineThread.submit` with token ids (text is accepted too). Admission
   control runs under a lock — draining: UNAVAILABLE; ``max_queue`` requests already waiting for
   a slot: RESOURCE_EXHAUSTED — then an ``_Add`` command goes on the thread-safe inbox and the
   caller gets a :class:`RequestStream`.
2. The engine thread blocks on the inbox while the engine has nothing to do (no busy spin).
   Otherwise it takes the queued commands without blocking — adds (``engine.add_request``; its
   ``ValueError`` fails that stream with INVALID_ARGUMENT), aborts, calls — and runs one
   ``engine.step()``.
3. Each ``RequestOutput`` becomes a :class:`Delta` put on its request's asyncio queue with
   ``loop.call_soon_threadsafe``; the stream's async iterator hands it to the front end. The
   queue is bounded (``stream_buffer`` outputs): a consumer that stops reading is aborted after
   ``stream_stall_timeout`` seconds (``serving/request_stream.py``).
4. A finished request is forgotten (``engine.forget``). An abort (client went away, deadline,
   or a consumer whose event loop has closed) calls ``engine.abort_request``: the slot and
   pages are free for the very next step.
5. If a step fails, the engine rebuilds its device state itself (compiled programs are reused)
   and raises ``StepFailed`` naming the requests that failed: those streams end with INTERNAL;
   requests that never reached the device stay queued, and the loop goes on.
6. :meth:`shutdown`: stop admitting, let in-flight requests finish until a deadline, fail the
   rest with UNAVAILABLE, end the thread. With a ``snapshot_dir`` the engine is snapshotted
   at once instead and gRPC clients resume their streams after the restart
   (``serving/resumable.py``: the protocol).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jbatch.engine.interface import EngineClient, StepFailed
from jbatch.outputs import RequestOutput
from jbatch.sampling_params import SamplingParams
from serving.errors import ServingError, Status
from serving.metrics import ServingMetrics
from serving.request_stream import Delta, RequestStream, StreamBuffers
from serving.resumable import ResumeRegistry
from serving.thread_snapshot import Resume, SnapshotStreams, deltas_of

__all__ = ["Delta", "EngineThread", "RequestStream"]

log = logging.getLogger(__name__)

_MAX_COMMANDS_PER_STEP = 4096  # bounds the time between steps when many requests arrive at once
_STALL_POLL_S = 0.01  # how often an idle engine thread looks at stalled streams


@dataclasses.dataclass
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival: float
    tenant: str | None = None
    client_id: str | None = None  # the gRPC request_id (resumable after a restart)


@dataclasses.dataclass
class _Adopt:
    """A request built on the engine thread by ``admit(engine, request_id)`` (a handover)."""

    stream: RequestStream
    admit: Callable[[EngineClient, str], Any]
    arrival: float


@dataclasses.dataclass
class _Abort:
    request_id: str
    outcome: str


@dataclasses.dataclass
class _Call:
    fn: Callable[[EngineClient], Any]
    future: concurrent.futures.Future


@dataclasses.dataclass
class _Stop:
    deadline: float


@dataclasses.dataclass
class _Live:
    """Engine-thread bookkeeping of an accepted request."""

    stream: RequestStream
    arrival: float
    last_token: float | None = None


class EngineThread(SnapshotStreams):
    """Drive ``engine`` from a dedicated thread; see the module docstring for the data flow."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        max_queue: int = 1024,
        metrics: ServingMetrics | None = None,
        name: str = "jbatch-engine",
        stream_buffer: int = 256,
        stream_stall_timeout: float = 30.0,
        snapshot_dir: str | Path | None = None,
        resume_ttl: float = 300.0,
    ):
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an int >= 1, got {max_queue!r}")
        self.engine = engine
        self.max_queue = max_queue  # may be changed while serving
        self.metrics = metrics or ServingMetrics()
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | _Stop] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0  # accepted and not yet retired (guarded by _lock)
        self._running = 0  # requests served (in slots or retiring), published after each step
        self._draining = False
        self._ids = itertools.count()
        self._id_prefix = f"srv-{secrets.token_hex(3)}-"  # unique per boot: restored ids stay
        self._resume = None if snapshot_dir is None else ResumeRegistry(snapshot_dir, resume_ttl)
        self._live: dict[str, _Live] = {}  # engine thread only
        self._stop_deadline: float | None = None  # engine thread only
        self._exiting = False
        self._failed_steps = 0  # consecutive steps that raised something other than StepFailed
        self._buffers = StreamBuffers(stream_buffer, stream_stall_timeout)  # engine thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- any thread -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread (first restoring a snapshot, when ``snapshot_dir`` holds one)."""
        if self._resume is not None and self._resume.has_snapshot:
            self._restore()  # the thread does not run yet: the engine is still ours
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._thread.is_alive() and not self._draining

    @property
    def num_outstanding(self) -> int:
        """Accepted requests not yet finished, aborted or failed."""
        return self._outstanding

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        tenant: str | None = None,
        client_id: str | None = None,
    ) -> RequestStream:
        """Queue a request (call from a coroutine: the stream lives on the running loop).

        Raises ServingError UNAVAILABLE (draining or stopped) or RESOURCE_EXHAUSTED (queue full).
        Errors of the prompt itself arrive through the stream as INVALID_ARGUMENT.
        """
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        make = lambda stream, now: _Add(stream, prompt, params, priority, now, tenant, client_id)
        return self._accept(make)

    def adopt(self, admit: Callable[[EngineClient, str], Any]) -> RequestStream:
        """Queue a request that ``admit(engine, request_id)`` builds on the engine thread (a
        handed-over request: ``serving/disagg_decode.py``); admission control as in
        :meth:`submit`, and a ``ValueError`` of ``admit`` fails the stream with
        INVALID_ARGUMENT."""
        return self._accept(lambda stream, now: _Adopt(stream, admit, now))

    def _accept(self, make: Callable[[RequestStream, float], Any]) -> RequestStream:
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self.accepting:
                raise ServingError(Status.UNAVAILABLE, "the server is shutting down")
            waiting = self._outstanding - self._running
            if waiting >= self.max_queue:
                raise ServingError(
                    Status.RESOURCE_EXHAUSTED,
                    f"request queue is full: {waiting} requests waiting for a slot "
                    f"(max_queue={self.max_queue}); retry later",
                )
            self._outstanding += 1
            stream = RequestStream(f"{self._id_prefix}{next(self._ids)}", self, loop)
            # Put under the lock: the engine thread's exit takes the lock before its last look
            # at the inbox, so an accepted request is always answered.
            self._inbox.put(make(stream, time.monotonic()))
        return stream

    def resume(self, client_id: str, from_token: int) -> RequestStream:
        """The stream of a request restored from a snapshot, from its ``from_token``-th
        generated token on (``serving/resumable.py``). NOT_FOUND arrives through the stream."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self.accepting:
                raise ServingError(Status.UNAVAILABLE, "the server is shutting down")
            self._outstanding += 1
            stream = RequestStream(f"{self._id_prefix}{next(self._ids)}", self, loop)
            self._inbox.put(Resume(stream, client_id, from_token))
        return stream

    def abort(self, request_id: str, outcome: str = "cancelled") -> None:
        """Abort a request by its server id; ``outcome`` is the metrics status label."""
        self._inbox.put(_Abort(request_id, outcome))

    def call(self, fn: Callable[[EngineClient], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between steps (inspection, tests). Once the
        thread has stopped (or before it started) the future fails at once with UNAVAILABLE."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # the thread's exit takes the lock before its last look at the inbox
            if self._exiting or not self._thread.is_alive():
                future.set_exception(ServingError(Status.UNAVAILABLE, "the engine has stopped"))
            else:
                self._inbox.put(_Call(fn, future))
        return future

    def begin_drain(self) -> None:
        """Refuse new requests (UNAVAILABLE); accepted ones keep running."""
        with self._lock:
            self._draining = True

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drain, give in-flight requests ``timeout`` seconds, fail the rest, join the thread
        (with a ``snapshot_dir``: snapshot the engine at once, then end every stream).

        Blocks: from a coroutine, run it in an executor so the loop keeps streaming meanwhile.
        """
        self.begin_drain()
        if self._thread.is_alive():
            self._inbox.put(_Stop(time.monotonic() + timeout))
            self._thread.join(timeout + 60.0)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                stopping = self._stop_deadline is not None
                self._take_commands(block=not stopping and not engine.has_unfinished_requests())
                if stopping and self._resume is not None:
                    self._snapshot()
                    break
                if self._stop_deadline is not None:
                    if not self._live and not engine.has_unfinished_requests():
                        break
                    if time.monotonic() >= self._stop_deadline:
                        self._fail_all(
                            ServingError(Status.UNAVAILABLE, "the server shut down first")
                        )
                        break
                if engine.has_unfinished_requests():
                    self._step()
                self._service_stalled()
                self._expire_parked()
                self._publish()
        except BaseException as e:  # a bug in this loop: fail everyone rather than hang them
            log.exception("engine thread crashed")
            self._fail_all(ServingError(Status.INTERNAL, f"engine thread crashed: {e!r}"))
        finally:
            with self._lock:
                self._draining = self._exiting = True
            self._take_commands(block=False)  # answer calls and adds that raced the exit
            self._buffers.flush_all()
            log.info("engine thread stopped")

    def _take_commands(self, block: bool) -> None:
        for i in range(_MAX_COMMANDS_PER_STEP):
            try:
                wait = _STALL_POLL_S if self._buffers.stalled else None
                cmd = self._inbox.get(block=block and i == 0, timeout=wait)
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Adopt):
                self._adopt(cmd)
            elif isinstance(cmd, Resume):
                self._resume_stream(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id, cmd.outcome)
            elif isinstance(cmd, _Call):
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as e:
                    cmd.future.set_exception(e)
            else:
                self._stop_deadline = cmd.deadline

    def _add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        if self._exiting:
            self._fail(cmd.stream, ServingError(Status.UNAVAILABLE, "the server shut down"))
            return
        try:
            self.engine.add_request(
                cmd.prompt, cmd.params, request_id=rid, priority=cmd.priority,
                arrival_time=cmd.arrival, tenant=cmd.tenant,
            )  # fmt: skip
        except ValueError as e:
            self._fail(cmd.stream, ServingError(Status.INVALID_ARGUMENT, str(e)))
            return
        self._attach(rid, cmd.stream, cmd.arrival)
        if self._resume is not None:
            self._resume.track(rid, cmd.client_id)

    def _adopt(self, cmd: _Adopt) -> None:
        rid = cmd.stream.request_id
        if self._exiting:
            self._fail(cmd.stream, ServingError(Status.UNAVAILABLE, "the server shut down"))
            return
        try:
            cmd.admit(self.engine, rid)
        except ValueError as e:
            self._fail(cmd.stream, ServingError(Status.INVALID_ARGUMENT, str(e)))
            return
        self._attach(rid, cmd.stream, cmd.arrival)

    def _attach(self, rid: str, stream: RequestStream, arrival: float) -> None:
        """From now on the engine request ``rid``'s outputs go to ``stream``."""
        self._live[rid] = _Live(stream, arrival)

    def _abort(self, request_id: str, outcome: str) -> None:
        self._buffers.discard(request_id)
        live = self._live.pop(request_id, None)
        if live is None:
            return  # finished (or failed) before the abort arrived
        self.engine.abort_request(request_id)
        self.engine.forget(request_id)
        live.stream._put(Delta([], "", finish_reason="abort"))
        self.metrics.outcome(outcome, "abort")
        self._count_retired()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
            self._failed_steps = 0
        except StepFailed as e:  # the engine has recovered; these requests failed with it
            log.error("%s; failing %d request(s)", e, len(e.failed))
            outputs = e.outputs
        except Exception as e:  # an engine that did not recover by itself
            self._failed_steps += 1
            self._recover(e)
            return
        now = time.monotonic()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                self._park_output(out)
                continue  # aborted meanwhile, or restored and waiting for its client
            if out.error is not None:
                del self._live[out.request_id]
                self.engine.forget(out.request_id)
                self._fail(live.stream, ServingError(_error_status(out), out.error))
                continue
            self._deliver(live, out, now)

    def _deliver(self, live: _Live, out: RequestOutput, now: float) -> None:
        if any(c.token_ids for c in out.outputs):
            if live.last_token is None:
                self.metrics.ttft.observe(now - live.arrival)
            else:
                self.metrics.itl.observe(now - live.last_token)
            live.last_token = now
        for delta in deltas_of(out):  # n > 1: one delta per choice
            self._buffers.push(live.stream, delta, now)
            if self._resume is not None:
                self._resume.sent(out.request_id, delta)
        if out.finished:
            if self._resume is not None:
                self._resume.forget(out.request_id)
            del self._live[out.request_id]
            self.engine.forget(out.request_id)
            self.metrics.e2e.observe(now - live.arrival)
            self.metrics.outcome("ok", delta.finish_reason)
            self._count_retired()

    def _recover(self, exc: Exception) -> None:
        """``step()`` raised something other than StepFailed: rebuild the engine's state, fail
        what it drops, keep what the device never saw (unless steps keep failing)."""
        log.exception("engine step failed; failing in-flight requests and rebuilding state")
        error = ServingError(Status.INTERNAL, f"engine step failed: {type(exc).__name__}: {exc}")
        for rid in self.engine.reset(requeue_waiting=self._failed_steps < 2):
            live = self._live.pop(rid, None)
            if live is not None:
                self._fail(live.stream, error)

    def _fail_all(self, error: ServingError) -> None:
        for rid, live in list(self._live.items()):
            self.engine.abort_request(rid)
            self.engine.forget(rid)
            self._fail(live.stream, error)
        self._live.clear()

    def _service_stalled(self) -> None:
        """Flush streams whose consumer caught up; abort those whose consumer went silent."""
        for stream in self._buffers.service(time.monotonic()):
            self.metrics.slow_consumer_aborts.inc()
            error = ServingError(
                Status.RESOURCE_EXHAUSTED,
                f"stream aborted: the client left {stream.buffered} outputs unread for "
                f"{self._buffers.stall_timeout:g}s (stream_buffer={self._buffers.limit})",
            )
            live = self._live.pop(stream.request_id, None)
            if live is None:  # finished already: only its last outputs were waiting
                stream._put(error)
                continue
            self.engine.abort_request(stream.request_id)
            self.engine.forget(stream.request_id)
            self._fail(stream, error)

    def _fail(self, stream: RequestStream, error: ServingError) -> None:
        """End an accepted request with ``error``."""
        self._buffers.discard(stream.request_id)
        stream._put(error)
        self.metrics.outcome(error.status.label)
        self._count_retired()

    def _count_retired(self) -> None:
        with self._lock:
            self._outstanding -= 1

    def _publish(self) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._running = stats.running + stats.retiring  # served, not waiting for a slot
            waiting = self._outstanding - self._running
        self.metrics.observe_engine(stats, waiting)


def _error_status(out: RequestOutput) -> Status:
    """How a failed request's stream ends: ``out.error_kind`` names a status, else INTERNAL."""
    kind = (out.error_kind or "").upper()
    return Status[kind] if kind in Status.__members__ else Status.INTERNAL
