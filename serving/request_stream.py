"""RequestStream (one request's outputs, engine thread -> consumer) and StreamBuffers (its bound).

A consumer that stops reading — a client that does not read its socket, so the front end's
``send`` blocks and it stops pulling from the stream — must not make the server hold unbounded
output. Each stream therefore holds at most ``limit`` undelivered outputs on the consumer's
queue. Past that, the engine thread coalesces further outputs into one pending
:class:`Delta` per choice (tokens and text appended, nothing lost: a slow reader simply gets bigger
chunks) and the stream is *stalled*. A stalled stream whose consumer takes nothing for
``stall_timeout`` seconds is given up: its request is aborted (slot and pages freed), the
stream ends with RESOURCE_EXHAUSTED, and ``jbatch_slow_consumer_aborts_total`` counts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol

from jbatch.outputs import TopLogprobs
from serving.errors import ServingError


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one engine step added to one choice (``index``) of a request; a choice's last delta
    has ``finish_reason`` set, and the stream ends with the last one of the last choice."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id / stop string that matched
    prompt_tokens: int = 0
    completion_tokens: int = 0  # generated so far, this delta included
    top_logprobs: list[TopLogprobs] | None = None  # per token, when the request asked
    prompt_logprobs: list[TopLogprobs | None] | None = None  # on the first delta that has them
    index: int = 0  # the choice (0..n-1)
    more_choices: bool = False  # other choices are still running: the stream goes on

    @property
    def finished(self) -> bool:
        """This choice is finished."""
        return self.finish_reason is not None

    @property
    def ends_stream(self) -> bool:
        return self.finished and not self.more_choices

    def then(self, later: Delta) -> Delta:
        """This delta followed by ``later``, as one."""
        top = self.top_logprobs
        if later.top_logprobs is not None:
            top = later.top_logprobs if top is None else top + later.top_logprobs
        return dataclasses.replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            top_logprobs=top,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


class _Owner(Protocol):
    def abort(self, request_id: str, outcome: str = "cancelled") -> None: ...


class RequestStream:
    """Async iterator over one request's :class:`Delta` s; raises :class:`ServingError`.

    Created by ``EngineThread.submit`` on the caller's event loop, fed by the engine thread.
    Call :meth:`abort` when the consumer gives up (cancellation, deadline, disconnect).
    """

    def __init__(self, request_id: str, owner: _Owner, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[Delta | ServingError] = asyncio.Queue()
        self.done = False
        # Each counter has one writer, so neither needs a lock: _sent the engine thread,
        # _taken the consumer's loop.
        self._sent = 0
        self._taken = 0
        # Engine thread only (StreamBuffers): the coalesced outputs past the limit, and since
        # when (and at which _taken) the stream has been stalled.
        self._overflow: dict[int, Delta] = {}  # by choice index
        self._stalled_at = 0.0
        self._taken_mark = 0

    @property
    def buffered(self) -> int:
        """Outputs handed to the consumer's queue and not yet taken."""
        return self._sent - self._taken

    def _put(self, item: Delta | ServingError) -> None:
        """Hand ``item`` to the consumer's loop (any thread). A closed loop means nobody is
        listening any more: the request is aborted (its slot and pages freed)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            self._sent += 1
        except RuntimeError:
            ended = isinstance(item, ServingError) or item.ends_stream
            if not self.done and not ended:
                self.done = True
                self._owner.abort(self.request_id, "disconnected")

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        self._taken += 1
        if isinstance(item, ServingError):
            self.done = True
            raise item
        if item.ends_stream:
            self.done = True
        return item

    def abort(self, outcome: str = "cancelled") -> None:
        """Stop generating (no-op once the stream has ended); ``outcome`` labels the metric."""
        if not self.done:
            self.done = True
            self._owner.abort(self.request_id, outcome)


class StreamBuffers:
    """The engine thread's side of the bound (see the module docstring)."""

    def __init__(self, limit: int = 256, stall_timeout: float = 30.0):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"stream_buffer must be an int >= 1, got {limit!r}")
        if not stall_timeout > 0:
            raise ValueError(f"stream_stall_timeout must be > 0 seconds, got {stall_timeout!r}")
        self.limit = limit
        self.stall_timeout = stall_timeout
        self.stalled: dict[str, RequestStream] = {}

    def push(self, stream: RequestStream, delta: Delta, now: float) -> None:
        """Deliver ``delta``, or coalesce it while the consumer's queue is full."""
        if not stream._overflow and stream.buffered < self.limit:
            stream._put(delta)
            return
        pending = stream._overflow.get(delta.index)
        stream._overflow[delta.index] = delta if pending is None else pending.then(delta)
        if stream.request_id not in self.stalled:
            stream._stalled_at, stream._taken_mark = now, stream._taken
            self.stalled[stream.request_id] = stream

    def service(self, now: float) -> list[RequestStream]:
        """Flush the streams whose consumer made room; return (and forget) those whose
        consumer took nothing for ``stall_timeout`` seconds."""
        expired = []
        for rid, stream in list(self.stalled.items()):
            if stream._taken != stream._taken_mark:  # reading, if slowly: not dead
                stream._stalled_at, stream._taken_mark = now, stream._taken
            if stream.buffered < self.limit:
                self._flush(rid)
            elif now - stream._stalled_at >= self.stall_timeout:
                self.discard(rid)
                expired.append(stream)
        return expired

    def discard(self, request_id: str) -> None:
        """Drop what a stream had pending (it is ending with an error or an abort)."""
        stream = self.stalled.pop(request_id, None)
        if stream is not None:
            stream._overflow = {}

    def flush_all(self) -> None:
        """Hand every pending output over regardless of the limit (the thread is exiting)."""
        for rid in list(self.stalled):
            self._flush(rid)

    def _flush(self, request_id: str) -> None:
        stream = self.stalled.pop(request_id)
        pending, stream._overflow = stream._overflow, {}
        for delta in sorted(pending.values(), key=lambda d: d.ends_stream):  # the end comes last
            stream._put(delta)
