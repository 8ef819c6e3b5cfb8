"""Slow and dead consumers: per-stream buffers are bounded, a stream whose consumer stops
reading is aborted after ``stream_stall_timeout`` (its slot and pages freed, counted in
``jbatch_slow_consumer_aborts_total``), and the streams that do read finish exact."""

from __future__ import annotations

import asyncio

import pytest

from serving.engine_thread import EngineThread
from serving.errors import ServingError, Status
from serving.request_stream import Delta, RequestStream, StreamBuffers
from tests.serving_harness import ENGINE, GREEDY, hardened_llm, slow_steps  # noqa: F401

BUFFER = 4


class _Owner:
    def __init__(self):
        self.aborted = []

    def abort(self, request_id, outcome="cancelled"):
        self.aborted.append(request_id)


def test_stream_buffers_coalesce_then_give_up():
    async def run():
        stream = RequestStream("r", _Owner(), asyncio.get_running_loop())
        buffers = StreamBuffers(limit=2, stall_timeout=1.0)
        for i in range(5):
            buffers.push(stream, Delta([i], str(i)), now=0.0)
        await asyncio.sleep(0)
        assert stream._queue.qsize() == 2 and stream._overflow[0].token_ids == [2, 3, 4]
        assert buffers.service(now=0.5) == []  # within the timeout
        first = await anext(stream)  # the consumer reads one: alive, room for the overflow
        assert buffers.service(now=5.0) == [] and not buffers.stalled
        rest = [await anext(stream), await anext(stream)]
        assert [t for d in [first, *rest] for t in d.token_ids] == [0, 1, 2, 3, 4]
        assert rest[-1].text == "234"
        for i in range(3):
            buffers.push(stream, Delta([i], ""), now=10.0)
        assert buffers.service(now=10.9) == []
        assert buffers.service(now=11.0) == [stream] and stream._overflow == {}

    asyncio.run(run())
    with pytest.raises(ValueError, match="stream_buffer"):
        StreamBuffers(limit=0)


def test_dead_readers_are_aborted_and_live_readers_are_exact(hardened_llm):  # noqa: F811
    """8 streams that never read and 32 that do, over one engine thread."""
    h = hardened_llm
    thread = EngineThread(h.engine, stream_buffer=BUFFER, stream_stall_timeout=0.3)
    thread.start()
    dead_params = GREEDY.replace(max_tokens=240)
    live = [(p, sp.replace(max_tokens=24)) for p, sp, _ in h.work[:32]]
    peak_buffered = [0]

    async def read(stream):
        return [t async for d in stream for t in d.token_ids]

    async def run():
        dead = [thread.submit([3 + i, 4, 5], dead_params) for i in range(8)]
        readers = [asyncio.ensure_future(read(thread.submit(p, sp))) for p, sp in live]
        while not all(r.done() for r in readers) or thread.num_outstanding:
            peak_buffered[0] = max([peak_buffered[0]] + [s._queue.qsize() for s in dead])
            await asyncio.sleep(0.005)
        results = await asyncio.gather(*readers)
        errors = []
        for stream in dead:
            while stream._queue.qsize() > 1:  # what was buffered, then the error
                stream._queue.get_nowait()
            with pytest.raises(ServingError) as info:
                await anext(stream)
            errors.append(info.value)
        return results, errors

    try:
        with slow_steps(thread, 0.002):
            results, errors = asyncio.run(asyncio.wait_for(run(), 60))

        def snapshot(engine):
            sched = engine.scheduler
            return sched.allocator.num_free, len(sched.free_slots), len(engine.requests)

        free = thread.call(snapshot).result(10)
    finally:
        thread.shutdown(10)
    assert results == [h.expected(p, 24) for p, _ in live]
    assert all(e.status is Status.RESOURCE_EXHAUSTED for e in errors)
    assert "unread for 0.3s" in errors[0].message and "stream_buffer=4" in errors[0].message
    assert peak_buffered[0] <= BUFFER + 1, peak_buffered  # + the final error
    assert thread.metrics.slow_consumer_aborts._value.get() == 8
    assert free == (ENGINE["num_pages"], ENGINE["max_slots"], 0)
