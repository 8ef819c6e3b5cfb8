"""The engine loop's contract on the MockCore: one dispatch per step, O(1) host work per token,
the packed step input, recovery from a failed step (engine, router, LLM, engine thread)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import jax
import numpy as np
import pytest

from jbatch import LLM, EngineConfig, LLMEngine, SamplingParams
from jbatch.engine import buckets
from jbatch.engine import request as request_module
from jbatch.engine.interface import EngineClient, StepFailed
from jbatch.engine.mock_core import MockCore, expected_tokens
from jbatch.engine.step_input import StepInputLayout
from jbatch.outputs import OutputKind
from jbatch.parallel.router import ReplicaRouter
from serving.engine_thread import EngineThread
from serving.errors import ServingError, Status

VOCAB = 97


def mock_engine(**cfg_kwargs) -> LLMEngine:
    cfg = EngineConfig(**{"block_q": 4, "page_size": 4, "num_pages": 64, "max_seq_len": 64,
                          "max_slots": 4, **cfg_kwargs})  # fmt: skip
    model_cfg = types.SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20)
    return LLMEngine(model_cfg, None, cfg, core=MockCore(cfg, VOCAB))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_all(engine) -> dict[str, list[int]]:
    """Step until idle; every request's tokens, rebuilt from the deltas."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens


def record_plans(engine) -> list:
    """The ``SchedulerOutput`` of every step ``engine`` plans from now on, in order."""
    plans, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda *a, **k: plans.append(schedule(*a, **k)) or plans[-1]
    return plans


def run_greedy_exact(engine, prompts, lengths) -> tuple[list[str], list]:
    """Queue a greedy request of ``lengths[i]`` tokens per prompt, step until idle: every
    request gets the mock's exact tokens. Returns the request ids and every step's plan."""
    ids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, lengths)]
    plans = record_plans(engine)
    tokens = run_all(engine)
    for rid, p, n in zip(ids, prompts, lengths):
        assert tokens[rid] == expected_tokens(p, n, 0, False, VOCAB)
    return ids, plans


def test_engines_implement_the_interface():
    eng = mock_engine()
    assert isinstance(eng, EngineClient)
    assert isinstance(ReplicaRouter([eng, mock_engine()]), EngineClient)


def test_one_dispatch_per_step_and_per_swap():
    eng = mock_engine(max_slots=3)
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(7)]
    for p in prompts:
        eng.add_request(p, greedy(6))
    run_all(eng)
    stats = eng.stats()
    assert stats.steps > 7 and stats.dispatches == stats.steps and stats.swap_outs == 0
    # The launching calls' host time is counted, as part of the host time.
    assert 0 < stats.dispatch_seconds <= stats.host_only_seconds
    # Step inputs are recycled once their step is fetched: a few per bucket, not one per step.
    made = len(eng.core._spare)
    assert 0 < made < stats.steps

    # A pool too small for everyone, swap preemption: each swap is one more dispatch.
    eng = mock_engine(max_slots=3, num_pages=16, max_num_batched_tokens=8,
                      preemption_mode="swap", enable_prefix_caching=False)  # fmt: skip
    ids = {eng.add_request([3 + i] * 14, greedy(12)): [3 + i] * 14 for i in range(3)}
    got = run_all(eng)
    stats = eng.stats()
    assert stats.swap_outs > 0
    assert stats.dispatches == stats.steps + 2 * stats.swap_outs  # out, and in again
    for rid, prompt in ids.items():
        assert got[rid] == expected_tokens(prompt, 12, 0, False, VOCAB)


def test_host_work_per_token_is_constant(monkeypatch):
    """Deltas carry one token each, page hashing is incremental (each page hashed once), and
    the text searched for stop strings stays bounded, whatever the generation length."""
    calls = []
    real = request_module.chain_hash
    monkeypatch.setattr(request_module, "chain_hash", lambda *a: calls.append(1) or real(*a))
    eng = mock_engine(max_slots=2, num_pages=600, max_seq_len=2048, max_num_batched_tokens=16)
    rid = eng.add_request([5, 6, 7], greedy(2000))
    n = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].num_tokens == n + 1
            n += 1
    assert n == 2000
    pages = (3 + 2000) // 4
    assert len(calls) <= pages + 1, f"{len(calls)} page hashes for {pages} pages"
    assert eng.requests[rid].pending_text == ""


def test_a_page_is_named_by_blake2b_over_its_parent_name_and_int64_tokens():
    """The name format a prefix cache (and a page import from another engine) relies on."""
    import hashlib

    from jbatch.engine.page_allocator import chain_hash

    def name(parent: bytes, tokens: list[int]) -> bytes:
        data = parent + np.asarray(tokens, np.int64).tobytes()
        return hashlib.blake2b(data, digest_size=16).digest()

    first = chain_hash(b"", [1, 2, 3, 4])
    assert first == name(b"", [1, 2, 3, 4])
    assert chain_hash(first, [5, 2**40, 0, np.int32(7)]) == name(first, [5, 2**40, 0, 7])
    assert chain_hash(first, [5, 6]) != chain_hash(b"", [5, 6])


def test_step_input_round_trip():
    cfg = EngineConfig(max_slots=4, page_size=4, num_pages=32, max_seq_len=32, block_q=4,
                       max_num_batched_tokens=16)  # fmt: skip
    layout = StepInputLayout.for_bucket(cfg, 16, 4)
    inp = layout.new()
    inp.release[2] = True
    inp.insert.mask[1] = True
    inp.insert.page_tables[1, :3] = [7, 8, 9]
    inp.insert.sampling.seed[1] = 2**32 - 5  # a uint32 beyond int32's range
    inp.insert.sampling.temperature[1] = 0.7
    inp.batch.decode_slots[:2] = [0, 3]
    inp.batch.prefill_positions[:3] = [0, 1, 2]
    release, ins, batch = inp.structured()
    assert release.dtype == bool and release.tolist() == [False, False, True, False]
    assert ins.mask.tolist() == [False, True, False, False]
    assert ins.sampling.seed.dtype == np.uint32 and int(ins.sampling.seed[1]) == 2**32 - 5
    # The jitted unpacking sees the same values; a fresh input holds only the defaults.
    traced = jax.jit(layout.unpack)(inp.ints, inp.floats)
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves((release, ins, batch))):
        np.testing.assert_array_equal(np.asarray(a), b)
    again = layout.new().structured()
    assert not again[0].any() and not again[1].mask.any()
    assert (again[2].decode_slots == cfg.max_slots).all()  # padding only


def _break_next_steps(engine: LLMEngine, n: int = 1) -> None:
    """The next ``n`` device steps are dispatched, then their host wrapper raises."""
    core, left = engine.core, [n]

    def faulty(*args):
        type(core).step(core, *args)
        left[0] -= 1
        if left[0] == 0:
            del core.step
        raise RuntimeError("injected fault")

    core.step = faulty


def test_failed_step_fails_only_the_requests_on_the_device():
    eng = mock_engine(max_slots=2)
    running = [eng.add_request([3, 4, 5], greedy(8)) for _ in range(2)]
    eng.step()
    eng.step()
    queued = eng.add_request([9, 10], greedy(5))  # waits: both slots are busy
    _break_next_steps(eng)
    with pytest.raises(StepFailed) as info:
        eng.step()
    failed = info.value
    assert sorted(failed.failed) == sorted(running) and "injected fault" in str(failed)
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in failed.outputs)
    eng.scheduler.check_invariants()
    assert run_all(eng) == {queued: expected_tokens([9, 10], 5, 0, False, VOCAB)}
    assert eng.stats().pages_used == 0


def test_router_failure_stays_on_its_replica():
    a, b = mock_engine(), mock_engine()
    router = ReplicaRouter([a, b])
    ids = [router.add_request([3 + i, 4], greedy(6)) for i in range(4)]
    on_a = [r for r in ids if router.replica_of(r) == 0]
    router.step()
    _break_next_steps(a)
    with pytest.raises(StepFailed) as info:
        router.step()
    assert sorted(info.value.failed) == sorted(on_a)
    assert any(o.request_id not in on_a and not o.outputs[0].finish_reason
               for o in info.value.outputs)  # fmt: skip
    got = run_all(router)
    for r in ids:
        if r not in on_a:
            assert len(got[r]) + 1 == 6  # the token of the first step was consumed above


def test_llm_generate_recovers_after_a_failed_step():
    llm = LLM.__new__(LLM)  # an LLM over a mock engine (no checkpoint needed)
    llm.engine = mock_engine(max_slots=2)
    prompts = [[3 + i, 4] for i in range(5)]
    _break_next_steps(llm.engine, 2)  # two in a row: the queued requests fail too
    outs = llm.generate(prompts, greedy(4), use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons.count("error") >= 2 and all(
        o.error for o in outs if o.outputs[0].finish_reason == "error"
    )
    again = llm.generate(prompts, greedy(4), use_tqdm=False)  # the engine is usable again
    for prompt, out in zip(prompts, again):
        assert out.outputs[0].token_ids == expected_tokens(prompt, 4, 0, False, VOCAB)
    assert llm.engine.stats().pages_used == 0 and not llm.engine.requests


def test_final_outputs_only_at_the_end():
    eng = mock_engine()
    rid = eng.add_request([3, 4], greedy(5), output_kind=OutputKind.FINAL)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert len(outs) == 1 and outs[0].request_id == rid and outs[0].finished
    assert outs[0].outputs[0].token_ids == expected_tokens([3, 4], 5, 0, False, VOCAB)


def test_engine_thread_call_after_shutdown_fails_fast():
    thread = EngineThread(mock_engine(), max_queue=8)
    thread.start()
    assert thread.call(lambda e: 7).result(5) == 7
    thread.shutdown(timeout=5)
    future = thread.call(lambda e: 7)
    with pytest.raises(ServingError) as info:
        future.result(1)  # answered at once, not after a timeout
    assert info.value.status is Status.UNAVAILABLE


def test_dead_consumer_aborts_its_request():
    """A stream whose event loop has closed is aborted: its slot and pages come back."""
    eng = mock_engine(max_slots=2)
    thread = EngineThread(eng, max_queue=8)
    thread.start()
    try:
        loop = asyncio.new_event_loop()

        async def submit():
            return thread.submit([3, 4, 5], greedy(60))

        loop.run_until_complete(submit())
        loop.close()  # the consumer is gone before reading anything
        for _ in range(200):
            if thread.num_outstanding == 0:
                break
            thread.call(lambda e: None).result(5)
        assert thread.num_outstanding == 0
        stats = thread.call(lambda e: e.stats()).result(5)
        assert stats.running == 0 and stats.pages_used == 0
    finally:
        thread.shutdown(timeout=5)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_slot_is_reused_the_step_after_its_last_token_is_dispatched(async_scheduling):
    """Retirement: a long request keeps one slot decoding while short ones pass through the
    other back to back. Each is admitted in the step after the one that samples its
    predecessor's last token (no idle slot while that token is in flight), the pages stay
    referenced until the token is read, and every output is still exact."""
    eng = mock_engine(max_slots=2, async_scheduling=async_scheduling, debug_checks=True)
    lens = [40, 3, 1, 5, 2, 4]
    prompts = [[7 + i, 8 + i, 9] for i in range(len(lens))]
    ids, _ = run_greedy_exact(eng, prompts, lens)
    # A 3-token prompt fits one chunk, which samples the first token: a request of n tokens
    # takes n steps, and the next one starts right after.
    starts = [eng.requests[rid].first_scheduled_step for rid in ids[1:]]
    assert starts == [starts[0] + sum(lens[1:i]) for i in range(1, len(lens))]
    sched = eng.scheduler
    assert not sched.retiring and sched.allocator.num_used == 0
    sched.check_invariants()


def test_aborting_a_retiring_request_frees_its_pages():
    eng = mock_engine(max_slots=1, debug_checks=True)
    first = eng.add_request([5, 6, 7], greedy(2))
    second = eng.add_request([8, 9, 10], greedy(3))
    eng.step()  # first: prefill + token 1
    eng.step()  # first: token 2 (its last) in flight
    eng.step()  # second admitted into first's slot; first retiring, its pages held
    sched = eng.scheduler
    assert eng.requests[second].slot == 0
    retiring = list(sched.retiring.values())
    assert [s.request_id for s in retiring] in ([first], [])  # [] if its token was read
    assert eng.stats().retiring == len(retiring) and eng.stats().running == 1
    eng.abort_request(first)
    assert not sched.retiring
    sched.check_invariants()
    tokens = run_all(eng)
    assert tokens[second] == expected_tokens([8, 9, 10], 3, 0, False, VOCAB)
    assert sched.allocator.num_used == 0


def test_blocks_of_decode_steps_stream_several_tokens_per_dispatch():
    """``decode_steps=4``: once every request decodes, a dispatch runs up to 4 steps and each
    request's delta carries the tokens it got; a stop token inside a block ends the request
    there (its other rows are dropped, its pages freed); outputs are the mock's exact ones."""
    eng = mock_engine(max_slots=3, decode_steps=4)
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(3)]
    full = expected_tokens(prompts[0], 20, 0, False, VOCAB)
    stop = full[9]
    ids = [eng.add_request(prompts[0], greedy(20).replace(stop_token_ids=[stop]))]
    ids += [eng.add_request(p, greedy(4 + 7 * i)) for i, p in enumerate(prompts[1:], 1)]
    sizes = []
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            sizes.append(len(out.outputs[0].token_ids))
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        eng.scheduler.check_invariants()
    assert got[ids[0]] == full[: full.index(stop) + 1]
    assert eng.requests[ids[0]].finish_reason == "stop"
    for i in (1, 2):
        assert got[ids[i]] == expected_tokens(prompts[i], 4 + 7 * i, 0, False, VOCAB)
    stats = eng.stats()
    assert stats.dispatches < stats.steps and max(sizes) == 4
    assert eng.scheduler.allocator.num_used == 0


def test_a_block_runs_past_a_request_end_while_its_idle_rows_stay_in_budget():
    """With a queue, a block runs past the first request's end for as long as the idle slot
    rows stay within ``BLOCK_IDLE_STEPS`` steps' worth of slots (then the queue gets the slot):
    2 slots, 8-step blocks, a third request queued. The step admitting the first two runs on
    as a block (an admission block); they can use 3 and 8 of its steps: idle rows 1, 2, 3, 4
    for blocks of 4..7 steps, 5 for 8 (over 2 x 2), so the block runs 7 steps."""
    from jbatch.engine.multi_step_planning import BLOCK_IDLE_STEPS

    assert BLOCK_IDLE_STEPS == 2  # the arithmetic above
    eng = mock_engine(max_slots=2, decode_steps=8, debug_checks=True)
    prompts = [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    lengths = (3, 30, 5)
    _, plans = run_greedy_exact(eng, prompts, lengths)
    first = plans[0]
    assert (len(first.chunks), first.steps, first.block_tokens) == (2, 7, [3, 7])
    assert eng.scheduler.allocator.num_used == 0


def test_an_admission_runs_on_as_a_block_past_a_request_at_its_last_token():
    """A request whose last token is sampled in the admitting step frees its slot at the next
    retirement, but the step still runs on as a block: that slot idles within the idle budget
    like a request ending inside a block. 2 slots, 4-step blocks, a third request queued: the
    first two (1 and 8 tokens) are admitted; the first is done after the first step (idle rows
    1, 2, 3 for blocks of 2..4: within 2 x 2), so the admission is a 4-step block. Before, the
    queued request made every such step an ordinary one (one dispatch per step while requests
    end one a step). A slot left free by the token budget still stops it (the next step admits
    into it): the third request's admission below."""
    eng = mock_engine(max_slots=2, decode_steps=4, debug_checks=True)
    prompts = [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    lengths = (1, 8, 4)
    _, plans = run_greedy_exact(eng, prompts, lengths)
    first = plans[0]
    assert (len(first.chunks), first.steps, first.block_tokens) == (2, 4, [1, 4])
    assert first.admission_block and eng.stats().admission_blocks >= 1
    assert eng.scheduler.allocator.num_used == 0

    # Token budget for one prompt a step: the step admitting the first leaves a slot free
    # while the second waits, so it stays an ordinary step.
    eng = mock_engine(max_slots=2, decode_steps=4, max_num_batched_tokens=4, block_q=4)
    for p, n in zip(prompts, (6, 6)):
        eng.add_request(p, greedy(n))
    plans = record_plans(eng)
    eng.step()
    assert len(plans[0].chunks) == 1 and plans[0].steps == 1 and not plans[0].admission_block


@pytest.mark.parametrize("arrives_mid_block", [False, True])
def test_a_block_that_may_hold_a_stop_lands_before_the_next_is_planned_while_requests_queue(
    arrives_mid_block,
):
    """2 slots, blocks of 8, a third request queued (from the start, or arriving while a
    block planned without a queue runs): A stops at its 2nd token (a stop id). Its block lands
    before the next is planned, so A is planned for one block, not two, and the queued request
    gets A's slot after at most 8 device steps instead of ~16."""
    eng = mock_engine(max_slots=2, decode_steps=8, num_pages=64, max_seq_len=256)
    stop = expected_tokens([5, 6, 7], 64, 0, False, VOCAB)[1]
    a = eng.add_request([5, 6, 7], greedy(64).replace(stop_token_ids=[stop]))
    eng.add_request([8, 9, 10], greedy(64))
    if arrives_mid_block:
        eng.step()  # the prompts, run on as a block planned with nothing queued
    c = eng.add_request([11, 12], greedy(4))
    A, C = eng.requests[a], eng.requests[c]
    while C.first_scheduled_step is None:
        before = eng.counters["steps"]
        eng.step()
    assert A.output_ids == [expected_tokens([5, 6, 7], 64, 0, False, VOCAB)[0], stop]
    assert A.num_sampled <= 8, A.num_sampled  # one block
    assert before <= 8, before  # device steps before C's admission
    run_all(eng)
    assert eng.scheduler.allocator.num_used == 0


@pytest.mark.parametrize("queued", [True, False])
def test_a_block_ends_on_the_device_once_a_stop_token_idles_its_slot_past_the_budget(queued):
    """2 slots, blocks of 8, a request queued: the step admitting A and B runs on as a block,
    and A samples its stop id at the block's second step. The device runs on while A's idle
    slot stays within ``BLOCK_IDLE_STEPS`` x 2 slot rows (4 more steps), then ends the block
    after 6 steps; B gives back the 2 tokens planned past it and gets exactly its tokens; the
    queued request starts 2 steps sooner than with a whole block. Without a queue the same
    block runs its whole count."""
    from jbatch.engine.multi_step_planning import BLOCK_IDLE_STEPS

    assert BLOCK_IDLE_STEPS == 2  # the arithmetic above
    eng = mock_engine(max_slots=2, decode_steps=8, max_seq_len=256, debug_checks=True)
    stop = expected_tokens([5, 6, 7], 64, 0, False, VOCAB)[1]
    a = eng.add_request([5, 6, 7], greedy(64).replace(stop_token_ids=[stop]))
    b = eng.add_request([8, 9, 10], greedy(30))
    if queued:
        c = eng.add_request([11, 12], greedy(4))
    plans = record_plans(eng)
    outs = eng.step()  # both prompts, and the block they run on into
    block = plans[-1]
    assert (len(block.chunks), block.steps, block.block_tokens) == (2, 8, [8, 8])
    assert block.idle_budget == (2 * BLOCK_IDLE_STEPS if queued else None)
    if queued:  # the next step lands the block (6 steps) and admits C
        outs += eng.step()
        assert eng.requests[c] in plans[-1].inserts
        assert eng.counters["steps"] - plans[-1].steps == 6
    tokens: dict[str, list[int]] = {}
    for out in outs:
        tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    for rid, rest in run_all(eng).items():
        tokens.setdefault(rid, []).extend(rest)
    assert tokens[a] == expected_tokens([5, 6, 7], 64, 0, False, VOCAB)[:2]
    assert tokens[b] == expected_tokens([8, 9, 10], 30, 0, False, VOCAB)
    stats = eng.stats()
    assert stats.blocks_ended_early == int(queued)
    if queued:
        assert tokens[c] == expected_tokens([11, 12], 4, 0, False, VOCAB)
    assert stats.tokens == sum(map(len, tokens.values()))
    assert eng.scheduler.allocator.num_used == 0


def test_a_block_cut_short_keeps_the_fair_queue_order():
    """``fair`` policy, 2 slots, blocks of 8: tenant a's request stops at the second step of
    the block its admission runs on into, so the device ends the block early and its planned
    tokens are given back. Tenant a stays charged for them (the fair queue's counters only
    grow), so a request of a that arrived while the block ran still has the smaller counter
    and is admitted first."""
    eng = mock_engine(max_slots=2, decode_steps=8, num_pages=64, max_seq_len=256,
                      scheduling_policy="fair", debug_checks=True)  # fmt: skip
    stop = expected_tokens([40, 41, 42], 64, 0, False, VOCAB)[1]
    eng.add_request([40, 41, 42], greedy(40).replace(stop_token_ids=[stop]), tenant="a")
    eng.add_request([10, 11, 12], greedy(40), tenant="b")
    eng.add_request([50, 51], greedy(4), tenant="a", priority=1)
    eng.add_request([20, 21], greedy(4), tenant="b")
    eng.add_request([22, 23], greedy(4), tenant="b")
    eng.step()  # both prompts, run on as a block
    a2 = eng.add_request([30, 31], greedy(4), tenant="a")
    plans = record_plans(eng)
    eng.step()  # lands the block (cut short), then admits into the freed slot
    assert eng.stats().blocks_ended_early == 1
    assert [s.request_id for s in plans[-1].inserts] == [a2]
    run_all(eng)
    assert eng.scheduler.allocator.num_used == 0


def test_without_a_queue_a_block_ends_where_a_smaller_decode_bucket_holds_the_rest():
    """64 slots, blocks of 16, 63 requests of 2 tokens and one of 40, nothing queued: the
    first block stops after the short ones' last step (it pays its 64-row bucket every step),
    and the long request goes on in 1-row blocks: the decode rows paid are those of stepping
    one step at a time, in a tenth of the dispatches."""

    def run(decode_steps: int) -> tuple[int, int, dict]:
        eng = mock_engine(max_slots=64, decode_steps=decode_steps, num_pages=1024,
                          max_seq_len=512, max_num_batched_tokens=512)  # fmt: skip
        paid, step = [], eng.core.step

        def counting(params, state, inp, bitmask=None):
            blocks = buckets.runs_blocks(eng.cfg, *inp.layout.key)
            decode_rows = inp.layout.key[1]
            paid.append(decode_rows * (int(inp.batch.decode_steps[0]) if blocks else 1))
            return step(params, state, inp, bitmask)

        eng.core.step = counting
        for i in range(63):
            eng.add_request([3 + i % 90, 4], greedy(2))
        eng.add_request([50, 51], greedy(40))
        tokens = run_all(eng)
        return sum(paid), len(paid), tokens

    (rows_1, dispatches_1, out_1), (rows_16, dispatches_16, out_16) = run(1), run(16)
    assert out_16 == out_1
    assert rows_16 <= rows_1 and dispatches_16 * 4 < dispatches_1, (rows_16, rows_1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(decode_steps=0), "decode_steps must be a positive int"),
        (dict(decode_steps=2, role="prefill"), "decode_steps=2 with role='prefill'"),
    ],
)
def test_bad_decode_steps_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_a_token_budget_below_max_slots_is_named():
    """Every decoding slot takes a token of the step's budget: a budget below ``max_slots``
    would leave slots idle (nothing is admitted once decodes use it up), so it is refused."""
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 must be >= max_slots=32"):
        EngineConfig(max_slots=32, max_num_batched_tokens=16)
    EngineConfig(max_slots=32, max_num_batched_tokens=16, role="prefill")  # decodes nothing


def test_no_block_or_speculation_while_a_retiring_slot_could_take_a_waiting_request():
    """One slot, two requests of 2 tokens: once the first one's last token is scheduled its
    slot frees at the next retirement, so the next step admits the second request: neither a
    block of decode steps nor a speculative step (both admit nobody) is planned."""
    from jbatch.engine.speculator import Speculator

    eng = mock_engine(max_slots=1, decode_steps=4)
    eng.add_request([3, 4, 5], greedy(2))
    eng.add_request([6, 7, 8], greedy(2))
    sched = eng.scheduler
    while not sched._last_samples:
        eng.step()
    assert sched.waiting and not sched.free_slots and sched.slot_for_waiting()
    assert sched.block_steps() == 1
    spec = dataclasses.replace(
        eng.cfg, speculative="ngram", speculative_max_batch=1, decode_steps=1
    )
    assert not Speculator(spec).wanted(sched)
