"""Fault injection (tests/fault_injection.py) under a serving load: a fault in the step's host
wrapper at step N, and one in detokenization, fail exactly the requests in flight (INTERNAL /
500), then the next requests are exact and no page or slot is left behind."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from serving.client import GenerationClient
from tests.fault_injection import fail_detokenize_at, fail_step_at
from tests.serving_harness import (  # noqa: F401
    assert_drained,
    hardened_llm,
    running_server,
    slow_steps,
)

IN_FLIGHT = 6
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def faulty(hardened_llm):  # noqa: F811
    with running_server(hardened_llm) as s:
        s.h = hardened_llm
        yield s


async def _stream(client, prompt, params, started: asyncio.Event | None = None):
    got = []
    try:
        async for resp in client.generate(prompt, params, timeout=60):
            got.extend(resp.token_ids)
            if started is not None:
                started.set()
        return "done", got
    except grpc.aio.AioRpcError as e:
        return e, got


def _in_flight_work(s):
    return [(p, sp.replace(max_tokens=MAX_TOKENS)) for p, sp, _ in s.h.work[:IN_FLIGHT]]


def _assert_in_flight_failed(s, results, needle):
    for (prompt, _), (outcome, got) in zip(_in_flight_work(s), results):
        assert isinstance(outcome, grpc.aio.AioRpcError), (outcome, len(got))
        assert outcome.code() == grpc.StatusCode.INTERNAL and needle in outcome.details()
        assert got == s.h.expected(prompt, MAX_TOKENS)[: len(got)]  # what came was right


def _next_requests_exact(s):
    async def run():
        async with GenerationClient(s.grpc_target) as client:
            work = s.h.work[IN_FLIGHT : IN_FLIGHT + 16]
            done = await asyncio.gather(*(client.complete(p, sp, timeout=60) for p, sp, _ in work))
        return [d.token_ids for d in done], [ref for _, _, ref in work]

    got, refs = asyncio.run(run())
    assert got == refs
    assert_drained(s)


async def _fault_while_all_stream(s, hook):
    """Start the in-flight requests, install ``hook`` once every one of them has streamed a
    token (so all are on the device however slow the machine), then collect the outcomes."""
    async with GenerationClient(s.grpc_target) as client:
        events = [asyncio.Event() for _ in range(IN_FLIGHT)]
        tasks = [
            asyncio.ensure_future(_stream(client, p, sp, ev))
            for (p, sp), ev in zip(_in_flight_work(s), events)
        ]
        await asyncio.gather(*(ev.wait() for ev in events))
        await asyncio.wrap_future(s.thread.call(hook))
        return await asyncio.gather(*tasks)


def test_step_fault_at_step_n_fails_only_the_requests_in_flight(faulty):
    hook = lambda engine: fail_step_at(engine, n=3)
    with slow_steps(faulty.thread, 0.005):
        results = asyncio.run(_fault_while_all_stream(faulty, hook))
    _assert_in_flight_failed(faulty, results, "injected step fault")
    assert "step" not in vars(faulty.h.engine.core)  # both hooks are gone
    _next_requests_exact(faulty)

    # One HTTP request, alone on the engine: the engine steps only while it is there.
    faulty.thread.call(lambda engine: fail_step_at(engine, n=2)).result(10)
    body = {"prompt": [7, 8, 9], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = httpx.post(faulty.http + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and "injected step fault" in r.json()["error"]["message"]
    _next_requests_exact(faulty)


def test_detokenizer_fault_fails_only_the_requests_in_flight(faulty):
    hook = lambda engine: fail_detokenize_at(engine, n=1)
    with slow_steps(faulty.thread, 0.005):
        results = asyncio.run(_fault_while_all_stream(faulty, hook))
    _assert_in_flight_failed(faulty, results, "injected detokenizer fault")
    assert "decode" not in vars(faulty.h.engine.tokenizer)
    _next_requests_exact(faulty)
