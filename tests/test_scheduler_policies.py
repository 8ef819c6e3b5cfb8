"""Scheduler policies on the hand-checkable MockCore: preemption, prefix caching, priorities and
aging, aborts — invariants after every step and exact outputs."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jbatch import EngineConfig, LLMEngine, SamplingParams
from jbatch.engine import buckets
from jbatch.engine.config import SCHEDULING_POLICIES
from jbatch.engine.mock_core import MockCore, expected_tokens

VOCAB = 97


def mock_engine(**cfg_kwargs) -> LLMEngine:
    cfg = EngineConfig(**{"block_q": 4, **cfg_kwargs})
    model_cfg = types.SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20)
    return LLMEngine(model_cfg, None, cfg, core=MockCore(cfg, VOCAB))


def params(max_tokens: int, seed: int | None = None) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def expected(prompt, p: SamplingParams) -> list[int]:
    return expected_tokens(prompt, p.max_tokens, p.seed or 0, p.temperature > 0, VOCAB)


def assert_drained(eng: LLMEngine) -> None:
    sched = eng.scheduler
    sched.check_invariants()
    assert not sched.running and not sched.waiting and not eng._inflight
    assert sched.allocator.num_used == 0, "pages still owned after the drain"
    assert sched.allocator.num_free == eng.cfg.num_pages, "pages lost"
    assert len(sched.free_slots) == eng.cfg.max_slots


request = st.fixed_dictionaries(
    {
        "prefix": st.integers(0, 2),
        "suffix": st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=10),
        "max_tokens": st.integers(1, 8),
        "seed": st.one_of(st.none(), st.integers(0, 1000)),
        "arrival": st.integers(0, 12),
        "priority": st.integers(0, 2),
        "abort_at": st.one_of(st.none(), st.integers(0, 30)),
        "tenant": st.sampled_from([None, "a", "b"]),
    }
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=14),
    slots=st.integers(1, 4),
    page_size=st.sampled_from([2, 4]),
    spare_pages=st.integers(0, 10),
    budget=st.sampled_from([4, 8, 16, 32]),
    caching=st.booleans(),
    aging=st.sampled_from([0, 3]),
    async_scheduling=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap", "auto"]),
    policy=st.sampled_from(SCHEDULING_POLICIES),
    decode_steps=st.sampled_from([1, 1, 3, 4]),
)
def test_random_workloads_keep_invariants_and_exact_outputs(
    reqs, slots, page_size, spare_pages, budget, caching, aging, async_scheduling, preemption,
    policy, decode_steps,
):  # fmt: skip
    max_seq_len = 48
    eng = mock_engine(
        max_slots=slots,
        page_size=page_size,
        max_seq_len=max_seq_len,
        num_pages=max_seq_len // page_size + spare_pages,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        aging_steps=aging,
        async_scheduling=async_scheduling,
        preemption_mode=preemption,
        scheduling_policy=policy,
        tenant_weights={"a": 2.0},
        decode_steps=decode_steps,
    )
    rng = np.random.RandomState(0)
    prefixes = [rng.randint(3, VOCAB, n).tolist() for n in (0, 9, 22)]
    prompts, ids = [], []
    for r in reqs:
        prompt = (prefixes[r["prefix"]] + r["suffix"]) or [5]
        prompts.append(prompt)
        ids.append(None)
    step = 0
    while step < 3000:
        for i, r in enumerate(reqs):
            if r["arrival"] == step:
                ids[i] = eng.add_request(
                    prompts[i], params(r["max_tokens"], r["seed"]), priority=r["priority"],
                    tenant=r["tenant"],
                )  # fmt: skip
            if r["abort_at"] is not None and r["abort_at"] == step and ids[i] is not None:
                eng.abort_request(ids[i])
        eng.step()
        eng.scheduler.check_invariants()
        step += 1
        if step > 13 and not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests(), "the workload did not finish"
    assert_drained(eng)
    for i, r in enumerate(reqs):
        seq = eng.requests[ids[i]]
        if seq.finish_reason == "abort":
            continue
        assert seq.finish_reason == "length"
        assert seq.output_ids == expected(prompts[i], params(r["max_tokens"], r["seed"]))


def test_prefix_cache_reuses_shared_pages_and_keeps_outputs():
    eng = mock_engine(
        max_slots=2, page_size=4, num_pages=32, max_seq_len=64, max_num_batched_tokens=16
    )
    system = list(range(10, 30))  # 20 shared tokens = 5 pages
    prompts = [system + [40 + i, 41 + i] for i in range(4)]
    for i, prompt in enumerate(prompts):
        rid = eng.add_request(prompt, params(5))
        while eng.has_unfinished_requests():
            eng.step()
        seq = eng.requests[rid]
        assert seq.output_ids == expected(prompt, params(5))
        assert seq.num_cached_tokens == (0 if i == 0 else 20)
    assert eng.scheduler.allocator.hit_rate > 0.7
    assert_drained(eng)


def test_preempted_sequence_resumes_from_its_cached_pages():
    # 12 pages of 4 tokens: three sequences growing to 36 tokens cannot all fit.
    eng = mock_engine(
        max_slots=3, page_size=4, num_pages=12, max_seq_len=40, max_num_batched_tokens=32
    )
    prompts = [[3 + i] * 20 for i in range(3)]
    ids = [eng.add_request(p, params(16)) for p in prompts]
    while eng.has_unfinished_requests():
        eng.step()
        eng.scheduler.check_invariants()
    assert eng.scheduler.num_preemptions > 0
    resumed = [eng.requests[i] for i in ids if eng.requests[i].num_preemptions]
    assert resumed and all(s.num_cached_tokens > 0 for s in resumed)
    for rid, prompt in zip(ids, prompts):
        assert eng.requests[rid].output_ids == expected(prompt, params(16))
    assert_drained(eng)


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swapped_sequences_resume_exactly(mode):
    eng = mock_engine(
        max_slots=3,
        page_size=4,
        num_pages=12,
        max_seq_len=40,
        max_num_batched_tokens=8,
        preemption_mode=mode,
        enable_prefix_caching=False,
    )
    prompts = [[3 + i] * 20 for i in range(3)]
    ids = [eng.add_request(p, params(16, seed=i)) for i, p in enumerate(prompts)]
    while eng.has_unfinished_requests():
        eng.step()
        eng.scheduler.check_invariants()
    assert eng.stats().swap_outs > 0
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        assert eng.requests[rid].output_ids == expected(prompt, params(16, seed=i))
    assert_drained(eng)


def test_preemption_picks_lowest_priority_first():
    eng = mock_engine(
        max_slots=2,
        page_size=4,
        num_pages=10,
        max_seq_len=40,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    urgent = eng.add_request([7] * 18, params(18), priority=0)
    background = eng.add_request([8] * 18, params(18), priority=5)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.requests[urgent].num_preemptions == 0
    assert eng.requests[background].num_preemptions > 0
    assert_drained(eng)


def run_flood(aging_steps: int, steps: int = 300) -> int | None:
    """Two slots, a continuous flood of short priority-0 requests, one long priority-1 prompt
    arriving at step 5. Returns how many steps the long request waited to start (None: never)."""
    eng = mock_engine(
        max_slots=2,
        page_size=4,
        num_pages=64,
        max_seq_len=128,
        max_num_batched_tokens=16,
        aging_steps=aging_steps,
    )
    long_seq = None
    for step in range(steps):
        for _ in range(2):
            eng.add_request([5, 6], params(3), priority=0)
        if step == 5:
            long_seq = eng.requests[eng.add_request(list(range(3, 83)), params(4), priority=1)]
            arrived = eng.scheduler.num_steps
        eng.step()
        if step % 50 == 0:
            eng.forget_finished()
    if long_seq.first_scheduled_step is None:
        return None
    return long_seq.first_scheduled_step - arrived


def test_aging_bounds_the_wait_of_a_low_priority_long_prompt():
    # Bound: the ~9 requests queued before it, plus what arrives (2 per step) while its priority
    # ages by one (8 steps), each holding one of the 2 slots for ~4 steps: (9 + 16) * 4 / 2 = 50.
    waited = run_flood(aging_steps=8)
    assert waited is not None and waited <= 50, f"waited {waited} steps"
    assert run_flood(aging_steps=0) is None, "without aging the flood should starve it"


def test_fit_prompt_rows_picks_the_nearest_bucket_above_the_smallest():
    cfg = EngineConfig(block_q=16, max_num_batched_tokens=512)
    assert buckets.prefill_buckets(cfg) == (0, 16, 32, 48, 64, 320, 640)  # 256, 512 packed
    wanted = (1, 16, 32, 48, 64, 80, 144, 160, 192, 256, 368, 384, 512, 600)
    fit = {w: buckets.fit_prompt_rows(cfg, w) for w in wanted}
    # never down to the single-block bucket; down while fewer rows are left over than padded
    assert fit == {1: 16, 16: 16, 32: 32, 48: 48, 64: 64, 80: 64, 144: 64, 160: 64, 192: 320,
                   256: 320, 368: 320, 384: 320, 512: 640, 600: 640}  # fmt: skip


@pytest.mark.parametrize(
    ("block_q", "budget", "want"),
    [(16, 32, (16, 32)), (16, 40, (16, 32, 48)), (16, 64, (16, 32, 48, 64)),
     (8, 256, (8, 16, 24, 32, 128, 256)), (16, 2048, (16, 32, 48, 64, 256, 1024, 2048)),
     (16, 100, (16, 32, 48, 64, 112))],
)  # fmt: skip
def test_prefill_buckets_are_whole_blocks_up_to_four_then_4x_apart(block_q, budget, want):
    """``want``: the dense rows of each prompt bucket; above four blocks a bucket is a packed
    region of 5/4 as many block rows (the chunks' block padding, ``buckets.region_rows``)."""
    cfg = EngineConfig(block_q=block_q, max_num_batched_tokens=budget, max_slots=32)
    region = {d: d if d <= 4 * block_q else d + -(-d // 4 // block_q) * block_q for d in want}
    regions = tuple(region[d] for d in want)
    assert buckets.prefill_buckets(cfg) == (0, *regions)
    assert buckets.prefill_buckets(dataclasses.replace(cfg, role="prefill")) == regions
    assert [buckets.dense_rows(cfg, r) for r in regions] == list(want)
    # Between the 4x rungs: the full decode bucket only (a busy batch admitting a prompt).
    rungs = {r for r in want if r == want[-1] or (r // block_q) not in (2, 3)}
    for rows in want:
        got = buckets.decode_buckets(cfg, region[rows])
        assert got == ((8, 32) if rows in rungs else (32,)), rows


@pytest.mark.parametrize(
    ("slots", "rows", "decodes", "pair"),
    [(32, 48, 2, (64, 8)),  # few decodes: the rung's quarter program (72 rows), not (48, 32)
     (32, 48, 9, (48, 32)),  # a busy batch admitting a prompt: the in-between bucket
     (32, 32, 0, (32, 32)),  # 64 rows, fewer than (64, 8)'s 72
     (256, 32, 0, (64, 16)),  # not (32, 256): a lone prompt on a big idle engine
     (256, 40, 31, (64, 64)), (32, 0, 3, (0, 4)), (32, 300, 32, (320, 32))],
)  # fmt: skip
def test_a_step_runs_the_compiled_pair_with_the_fewest_rows(slots, rows, decodes, pair):
    cfg = EngineConfig(block_q=16, max_num_batched_tokens=512, max_slots=slots)
    assert buckets.pick_pair(cfg, rows, decodes) == pair
    # 300 block rows of 280 tokens: the 320-row region computes only 256 of them.
    assert buckets.pick_pair(cfg, 300, 32, tokens=280) == (640, 32 if slots == 32 else 64)
    pairs = buckets.bucket_pairs(cfg)
    cost = lambda pair: buckets.dense_rows(cfg, pair[0]) + pair[1]  # the rows it computes
    for r in range(0, 641, 16):  # every step: the pick holds it, none holding it is cheaper
        for d in range(slots + 1):
            got = buckets.pick_pair(cfg, r, d)
            assert got in pairs and got[0] >= r and got[1] >= d
            assert cost(got) == min(cost(p) for p in pairs if p[0] >= r and p[1] >= d), (r, d)
    # The scheduler plans prompt rows for what such a step runs: with few decodes a 40-row
    # want is cut to 32 (the 48-row program would pad 32 decode rows), with many it gets 48.
    if slots == 32:
        assert [buckets.fit_prompt_rows(cfg, 40, d) for d in (2, 31)] == [32, 48]


@pytest.mark.parametrize(
    ("slots", "want"),
    [(8, (1, 2, 4, 8)), (16, (1, 2, 4, 8, 16)), (32, (1, 2, 4, 8, 16, 24, 32)),
     (256, (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)), (100, (1, 3, 6, 12, 25, 50, 75, 100))],
)  # fmt: skip
def test_decode_only_buckets_halve_down_to_one_row_and_add_three_quarters_of_max_slots(slots, want):
    cfg = EngineConfig(block_q=16, max_num_batched_tokens=512, max_slots=slots)
    assert buckets.decode_buckets(cfg, 0) == want
    if slots == 32:  # 17-24 decodes run 24 rows, 25 run the full bucket
        assert [buckets.pick_pair(cfg, 0, d) for d in (16, 17, 24, 25)] == [
            (0, 16), (0, 24), (0, 24), (0, 32)
        ]  # fmt: skip


def test_short_prompts_fill_a_packed_region_to_its_token_budget():
    """32 prompts of 39 tokens (48 block rows each: 1 536 rows, 1 248 tokens) through a
    512-token budget: each step's prompt tokens fill what its decodes leave of the budget in
    the packed 640-row region (512, then 499 beside the 13 prompts done in the first), the
    third step the 237 left in the 320-row region (256 dense rows) — 1 280 prompt rows
    computed, where whole blocks took 512 + 512 + 512. Outputs are exact, nothing leaks."""
    eng = mock_engine(
        block_q=16, max_num_batched_tokens=512, max_slots=32, num_pages=512, max_seq_len=64
    )
    prompts = [[3 + (i * 7 + j) % 90 for j in range(39)] for i in range(32)]
    ids = [eng.add_request(p, params(3)) for p in prompts]
    got = {i: [] for i in ids}
    steps = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id].extend(o.outputs[0].token_ids)
        if eng._inflight:
            sched = eng._inflight[-1][0]
            if sched.chunks:
                pair = buckets.pick_pair(
                    eng.cfg, sched.prompt_rows, len(sched.decodes), sched.prompt_tokens
                )
                steps.append((sched.prompt_tokens, sched.prompt_rows, pair[0]))
        eng.scheduler.check_invariants()
    assert [(t, r) for t, _, r in steps] == [(512, 640), (499, 640), (237, 320)], steps
    assert all(rows <= region for _, rows, region in steps)
    assert [buckets.dense_rows(eng.cfg, r) for _, _, r in steps] == [512, 512, 256]
    assert all(got[i] == expected(p, params(3)) for i, p in zip(ids, prompts))
    assert_drained(eng)


def test_a_budget_of_one_block_has_one_prefill_bucket():
    cfg = EngineConfig(block_q=16, max_num_batched_tokens=16, max_slots=16)
    assert buckets.prefill_buckets(cfg) == (0, 16)
    assert buckets.prefill_buckets(dataclasses.replace(cfg, role="prefill")) == (16,)
    assert buckets.decode_buckets(cfg, 16) == (16,)  # quarters of 16 are below 8 rows


def test_a_prompt_just_past_a_bucket_is_chunked_not_padded_to_the_next():
    """70 prompt tokens with decodes running: 64 rows now and the rest next step, not one
    step padded to 256 rows; the outputs are unchanged."""
    eng = mock_engine(
        block_q=16, max_num_batched_tokens=512, max_slots=4, num_pages=64, max_seq_len=128
    )
    first = eng.add_request([5, 6, 7], params(8))
    assert eng.step() == []  # its first token is in flight
    prompt = [3 + i % 90 for i in range(70)]
    late = eng.add_request(prompt, params(4))
    got = {first: []}
    for i in range(2):  # the 70-token prompt's two steps (the step in flight: _inflight[-1])
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        sched = eng._inflight[-1][0]
        assert [len(c.token_ids) for c in sched.chunks] == [(64, 6)[i]]
        assert buckets.pick_bucket(eng.cfg, sched.prompt_rows) == (64, 16)[i]
    while eng.has_unfinished_requests():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    assert got[late] == expected(prompt, params(4))
    assert got[first] == expected([5, 6, 7], params(8))
    assert_drained(eng)
