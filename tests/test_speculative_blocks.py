"""Several speculative steps per dispatch (``decode_steps`` > 1 with speculation;
``engine/spec_block.py``): greedy output is HF's under swap preemption and prefix caching, with
n-gram proposals and with a draft model; the stream grows on the device between steps (the
same proposals and acceptances as step by step); stop conditions cut inside a block; blocks of
plain decode steps (more requests than ``speculative_max_batch``) and speculative dispatches
never overlap; no recompiles; no page leaks with random aborts."""

from __future__ import annotations

import numpy as np
import pytest

from jbatch import LLM, SamplingParams
from tests.compile_counter import count_compiles
from tests.test_engine import assert_drained, assert_teacher_forced, churn_with_random_aborts
from tests.test_speculative import SPEC, assert_stops_cut_runs, repetitive_prompts

# Four slots, speculation up to two decoding requests: with three or four, plain blocks run.
BLOCKS = {**SPEC, "decode_steps": 3, "speculative_max_batch": 2, "num_pages": 48}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(hf_checkpoint):
    """The llama checkpoint speculating in blocks of 3 steps, and step by step."""
    path, model = hf_checkpoint("llama")
    return LLM(path, **BLOCKS), LLM(path, **{**BLOCKS, "decode_steps": 1}), model


def spec_dispatches(llm: LLM) -> int:
    return sum(n for key, n in llm.engine.core.programs_run.items() if key[0] == "spec")


def test_greedy_blocks_are_hfs_under_swap_and_prefix_cache(engines):
    """More work than the pool holds, a shared system prefix, two to eight requests at a time
    (speculative blocks and plain blocks): HF's tokens; several speculative steps per
    speculative dispatch; nothing compiled."""
    llm, _, model = engines
    rng = np.random.RandomState(4)
    system = rng.randint(3, 384, 16).tolist()
    batch = [system + rng.randint(3, 384, 20).tolist() + p for p in repetitive_prompts(384, 8, 5)]
    params = [GREEDY.replace(max_tokens=int(m)) for m in rng.randint(60, 90, len(batch))]
    before, dispatched = llm.engine.stats(), spec_dispatches(llm)
    with count_compiles() as compiled:
        outs = llm.generate(batch[:2], params[:2], use_tqdm=False)  # two: speculative only
        outs += llm.generate(batch[2:], params[2:], use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    for prompt, out, p in zip(batch, outs, params):
        assert len(out.outputs[0].token_ids) == p.max_tokens
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    stats = llm.engine.stats()
    spec_steps = stats.spec_steps - before.spec_steps
    assert spec_steps > 1.5 * (spec_dispatches(llm) - dispatched), "few steps per dispatch"
    assert stats.swap_outs > before.swap_outs and stats.prefix_cache_hits > 0
    assert stats.spec_accepted_tokens > before.spec_accepted_tokens
    assert_drained(llm)


def test_blocks_propose_what_step_by_step_proposes(engines):
    """The n-gram stream grows on the device inside a block: one request at a time, the block
    engine verifies and accepts exactly the proposals of the step-by-step engine, and a mix
    of greedy, seeded, penalised, logprob and opted-out requests is deterministic."""
    blocks, steps, _ = engines
    prompts = repetitive_prompts(384, 3, seed=13)
    counts = []
    for llm in (blocks, steps):
        before = llm.engine.stats()
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        after = llm.engine.stats()
        counts.append(
            (
                [o.outputs[0].token_ids for o in outs],
                after.spec_proposed_tokens - before.spec_proposed_tokens,
                after.spec_accepted_tokens - before.spec_accepted_tokens,
            )
        )
    assert counts[0] == counts[1] and counts[0][2] > 0, counts
    base = SamplingParams(max_tokens=24, ignore_eos=True)
    mix = [
        base.replace(temperature=0.8, seed=1),
        base.replace(temperature=0.0, presence_penalty=0.5),
        base.replace(temperature=0.0, logprobs=2),
        base.replace(temperature=0.0, speculative=False),
    ]
    with count_compiles() as compiled:
        first, second = (blocks.generate(prompts[:1] * 4, mix, use_tqdm=False) for _ in "ab")
    assert compiled == []
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert len(first[2].outputs[0].logprobs) == 24
    assert_drained(blocks)


def test_stop_conditions_cut_inside_a_block(engines):
    assert_stops_cut_runs(engines[0])


def test_plain_blocks_land_before_a_speculative_dispatch(engines, monkeypatch):
    """A plain block's tokens are not kept for the next speculative dispatch's n-gram stream:
    a speculative dispatch is never planned while one is in flight."""
    llm, _, _ = engines
    engine, seen = llm.engine, []
    dispatch = engine.core.step

    def step(params, state, inp, bitmask=None):
        prev = engine._inflight[-1][0] if engine._inflight else None
        if prev is not None:
            seen.append((inp.layout.key[0] == "spec", prev.drafts is None and prev.steps > 1))
        return dispatch(params, state, inp, bitmask)

    monkeypatch.setattr(engine.core, "step", step)
    prompts = repetitive_prompts(384, 4, seed=17)
    params = [GREEDY.replace(max_tokens=m) for m in (12, 20, 40, 40)]  # 4, then 2 decoding
    llm.generate(prompts, params, use_tqdm=False)
    assert any(plain for _, plain in seen) and any(spec for spec, _ in seen), seen
    assert not any(spec and plain for spec, plain in seen)


def test_no_page_leaks_with_random_aborts(engines):
    llm, _, _ = engines
    churn_with_random_aborts(llm.engine, repetitive_prompts(384, 40, seed=12), 300, 24)
    assert llm.engine.stats().spec_accepted_tokens > 0
    assert_drained(llm)


def test_draft_model_blocks_are_the_targets_greedy_output(hf_checkpoint):
    """The target as its own draft, two speculative steps per dispatch: HF's tokens, nearly
    every proposal accepted (the draft pool follows the target's inside a block)."""
    from tests.test_draft_speculative import ENGINE

    path, model = hf_checkpoint("llama")
    llm = LLM(path, speculative_model=str(path), **{**ENGINE, "decode_steps": 2})
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 384, int(n)).tolist() for n in (5, 19, 11)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    stats = llm.engine.stats()
    assert stats.spec_steps > 1.5 * spec_dispatches(llm)
    assert stats.spec_accepted_tokens >= 0.95 * stats.spec_proposed_tokens > 50
    assert_drained(llm)
