"""The engine thread's snapshot and resume steps (``jbatch serve --snapshot-dir``).

A mixin of :class:`serving.engine_thread.EngineThread`: these methods run on the engine thread
and use its bookkeeping (``_live``, ``_buffers``, ``_fail``, ...). The protocol and what is
kept are in ``serving/resumable.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time

from jbatch.outputs import RequestOutput
from serving.errors import ServingError, Status
from serving.request_stream import Delta, RequestStream
from serving.resumable import read_streams, replay, write_streams

log = logging.getLogger("serving.engine_thread")


@dataclasses.dataclass
class Resume:
    """The engine-thread command of ``EngineThread.resume``."""

    stream: RequestStream
    client_id: str
    from_token: int


class SnapshotStreams:
    def _snapshot(self) -> None:
        """Snapshot the engine, record each stream's client and sent deltas, end the streams."""
        reg = self._resume
        try:
            outputs = self.engine.snapshot(reg.directory)
        except Exception as e:
            log.exception("engine snapshot failed")
            self._fail_all(ServingError(Status.UNAVAILABLE, f"snapshot failed: {e}"))
            return
        now = time.monotonic()
        for out in outputs:  # the step that was in flight: delivered, then in the records
            live = self._live.get(out.request_id)
            if live is not None:
                self._deliver(live, out, now)
            else:
                self._park_output(out)
        streams = dict(reg.history)
        streams.update({rid: (p.client_id, p.deltas) for rid, p in reg.parked.items()})
        write_streams(reg.directory, streams)
        log.info("engine snapshot of %d request(s) written to %s", len(streams), reg.directory)
        for rid, live in list(self._live.items()):
            client = reg.history.get(rid, (None,))[0]
            how = f"resume with request_id={client!r}, resume=true" if client else "retry"
            self._fail(live.stream, ServingError(Status.UNAVAILABLE, f"server restarting: {how}"))
        self._live.clear()
        self.engine.reset(requeue_waiting=False)  # this engine is done: the snapshot holds all

    def _restore(self) -> None:
        reg = self._resume
        self.engine.restore(reg.directory)
        streams = read_streams(reg.directory)
        for rid in reg.park(streams):  # came over HTTP: nobody can resume them
            self.engine.abort_request(rid)
            self.engine.forget(rid)
        shutil.rmtree(reg.directory)  # consumed: a later restart must not replay it
        log.info("restored %d request(s) from %s", len(streams), reg.directory)

    def _park_output(self, out: RequestOutput) -> None:
        parked = None if self._resume is None else self._resume.parked.get(out.request_id)
        if parked is not None:
            parked.deltas.extend(deltas_of(out))
            if out.finished:
                parked.finished = True
                self.engine.forget(out.request_id)

    def _resume_stream(self, cmd: Resume) -> None:
        claimed = None if self._resume is None else self._resume.claim(cmd.client_id)
        if claimed is None:
            msg = f"no restored request with request_id={cmd.client_id!r} to resume"
            self._fail(cmd.stream, ServingError(Status.NOT_FOUND, msg))
            return
        rid, parked = claimed
        now = time.monotonic()
        if not parked.finished:  # the new stream takes over the engine request's id
            cmd.stream.request_id = rid
        for delta in replay(parked.deltas, cmd.from_token):
            self._buffers.push(cmd.stream, delta, now)
        if parked.finished:
            self.metrics.outcome("ok", parked.deltas[-1].finish_reason if parked.deltas else None)
            self._count_retired()
            return
        self._attach(rid, cmd.stream, now)
        self._resume.track(rid, cmd.client_id)
        self._resume.history[rid][1].extend(parked.deltas)

    def _expire_parked(self) -> None:
        if self._resume is None or not self._resume.parked:
            return
        for rid in self._resume.expired(time.monotonic()):
            self.engine.abort_request(rid)
            self.engine.forget(rid)


def deltas_of(out: RequestOutput) -> list[Delta]:
    """One delta per completion in ``out`` (n > 1: several); the stream ends with the last one
    of a finished request (``more_choices`` false)."""
    last = len(out.outputs) - 1
    return [
        Delta(
            token_ids=c.token_ids,
            text=c.text,
            finish_reason=c.finish_reason if c.finished() else None,
            stop_reason=c.stop_reason if c.finished() else None,
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=c.num_tokens,
            top_logprobs=c.top_logprobs,
            prompt_logprobs=out.prompt_logprobs,
            index=c.index,
            more_choices=not (out.finished and i == last),
        )
        for i, c in enumerate(out.outputs)
    ]
