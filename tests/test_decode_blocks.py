"""Blocks of decode steps (``EngineConfig.decode_steps``; ``core.decode_block``) on a real model:
greedy output is HF's under swap preemption and prefix caching, every kind of request gets the
same tokens as step by step (seeded sampling included), stop conditions cut inside a block, no
program compiles after warm-up and no page leaks with random aborts."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jbatch import LLM, SamplingParams
from tests.compile_counter import count_compiles
from tests.test_engine import assert_drained, assert_teacher_forced, churn_with_random_aborts

BLOCKS = dict(
    max_slots=4,
    page_size=8,
    num_pages=36,
    max_num_batched_tokens=32,
    max_seq_len=160,
    block_q=16,
    preemption_mode="swap",
    debug_checks=True,
    decode_steps=4,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompts(n: int, seed: int, vocab: int = 384) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(3, vocab, int(rng.randint(2, 20))).tolist() for _ in range(n)]


def assert_blocks_ran(llm: LLM, before, admissions: bool = False) -> None:
    """Most model steps since ``before`` ran in blocks (fewer dispatches than steps); with
    ``admissions``, some of them steps that admitted prompts and ran on (admission blocks)."""
    stats = llm.engine.stats()
    steps, dispatches = stats.steps - before.steps, stats.dispatches - before.dispatches
    assert dispatches < 0.7 * steps, f"{dispatches} dispatches for {steps} steps: few blocks"
    if admissions:
        assert stats.admission_blocks > before.admission_blocks, "no admission block ran"


@pytest.fixture(scope="module")
def engines(hf_checkpoint):
    """The llama checkpoint with blocks of 4 decode steps, and step by step."""
    path, model = hf_checkpoint("llama")
    return LLM(path, **BLOCKS), LLM(path, **{**BLOCKS, "decode_steps": 1}), model


def test_greedy_blocks_are_hfs_under_swap_and_prefix_cache(engines):
    """More work than the pool holds (swap preemption), a shared system prefix: HF's tokens,
    blocks of several steps per dispatch, nothing compiled."""
    llm, _, model = engines
    rng = np.random.RandomState(4)
    system = rng.randint(3, 384, 16).tolist()
    batch = [system + p for p in prompts(8, seed=5)]
    params = [GREEDY.replace(max_tokens=int(m)) for m in rng.randint(60, 90, len(batch))]
    before = llm.engine.stats()
    with count_compiles() as compiled:
        outs = llm.generate(batch, params, use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    for prompt, out, p in zip(batch, outs, params):
        assert len(out.outputs[0].token_ids) == p.max_tokens
        assert_teacher_forced(model, prompt, out.outputs[0].token_ids)
    stats = llm.engine.stats()
    assert stats.swap_outs > before.swap_outs and stats.prefix_cache_hits > 0
    assert_blocks_ran(llm, before, admissions=True)
    assert_drained(llm)


def test_every_kind_of_request_gets_the_tokens_of_step_by_step(engines):
    """Greedy, seeded sampled, penalised, logprob, prompt-logprob, EOS-stopped and stop-id
    requests side by side, more than the slots (admission blocks start the later ones): the
    same tokens (and texts, logprobs) with blocks as without."""
    blocks, steps, _ = engines
    batch = prompts(9, seed=7)
    base = SamplingParams(max_tokens=30, ignore_eos=True)
    params = [
        base.replace(temperature=0.0),
        base.replace(temperature=0.8, seed=1),
        base.replace(temperature=1.0, top_k=5, seed=2),
        base.replace(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3),
        base.replace(temperature=0.0, logprobs=2),
        base.replace(temperature=0.7, top_p=0.9, seed=3, ignore_eos=False),
        base.replace(temperature=0.9, seed=4, repetition_penalty=1.3),
        base.replace(temperature=0.0, stop_token_ids=[7, 11, 13]),
        base.replace(temperature=0.5, seed=5, prompt_logprobs=3, presence_penalty=0.4),
    ]
    before = blocks.engine.stats()
    with count_compiles() as compiled:
        got = blocks.generate(batch, params, use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert_blocks_ran(blocks, before, admissions=True)
    want = steps.generate(batch, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        a_sum, b_sum = a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob
        np.testing.assert_allclose(a_sum, b_sum, rtol=1e-5)
    assert got[4].outputs[0].logprobs == want[4].outputs[0].logprobs
    assert got[8].prompt_logprobs == want[8].prompt_logprobs and got[8].prompt_logprobs
    assert_drained(blocks)


def test_stop_conditions_cut_inside_a_block(engines):
    """A stop token or max_tokens inside a block ends the output exactly there; the block's
    other rows are dropped and the request's pages come back."""
    llm, _, _ = engines
    prompt = prompts(1, seed=9)[0]
    before = llm.engine.stats()
    full = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_blocks_ran(llm, before)
    for at in (5, 10, 14):
        stop = full[at]
        cut = llm.generate([prompt], GREEDY.replace(stop_token_ids=[stop]), use_tqdm=False)[0]
        assert cut.outputs[0].token_ids == full[: full.index(stop) + 1]
        assert cut.outputs[0].finish_reason == "stop"
    for m in (1, 2, 3, 5, 6, 13):
        short = llm.generate([prompt], GREEDY.replace(max_tokens=m), use_tqdm=False)[0]
        assert short.outputs[0].token_ids == full[:m]
    assert_drained(llm)


def test_blocks_end_on_the_device_at_stop_tokens_while_requests_queue(engines, monkeypatch):
    """More requests than slots, half stopping at a token of their own greedy output: blocks
    planned while requests queue carry the stop ids, the device ends them early (here with no
    idle allowance: the step after a stop), the others give back the tokens planned past it
    (else they would end short of ``max_tokens``), and every request gets the tokens and
    finish reason of step by step; nothing compiles."""
    from jbatch.engine import multi_step_planning

    monkeypatch.setattr(multi_step_planning, "BLOCK_IDLE_STEPS", 0)
    blocks, steps, _ = engines
    batch = prompts(10, seed=11)
    full = [o.outputs[0].token_ids for o in steps.generate(batch, GREEDY, use_tqdm=False)]
    params = [
        GREEDY.replace(stop_token_ids=[f[5 + 2 * i]]) if i % 2 else GREEDY
        for i, f in enumerate(full)
    ]
    before = blocks.engine.stats()
    with count_compiles() as compiled:
        got = blocks.generate(batch, params, use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert blocks.engine.stats().blocks_ended_early > before.blocks_ended_early
    assert_blocks_ran(blocks, before)
    for out, want, p in zip(got, full, params):
        if p.stop_token_ids:
            want = want[: want.index(p.stop_token_ids[0]) + 1]
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == ("stop" if p.stop_token_ids else "length")
    assert_drained(blocks)


def test_no_page_leaks_with_random_aborts(engines):
    llm, _, _ = engines
    churn_with_random_aborts(llm.engine, prompts(40, seed=12), requests=300, max_tokens=16)
    assert_drained(llm)


def test_a_replay_of_a_runs_dispatches_does_the_same_device_work(engines, monkeypatch):
    """``scripts/dispatch_replay.py`` (what ``bench_host.py`` compares a run's wall time with):
    the run's step programs, replayed from the state the run started from, return the run's
    packed results bit for bit — blocks, admission blocks and ordinary steps alike."""
    monkeypatch.syspath_prepend(Path(__file__).resolve().parents[1] / "scripts")  # undone after
    from dispatch_replay import DispatchRecorder, replay

    blocks, steps, _ = engines
    for llm in (blocks, steps):
        engine = llm.engine
        start = jax.tree.map(jnp.copy, engine.state)
        params = [GREEDY.replace(max_tokens=n) for n in (9, 30, 5, 17, 24, 3)]
        with DispatchRecorder(engine) as recorded:
            engine_outs = llm.generate(prompts(6, seed=12), params, use_tqdm=False)
        assert len(recorded.steps) == len(recorded.results) > 3
        wall, results = replay(engine, recorded, start)
        assert wall > 0 and len(results) == len(recorded.results)
        for ran, again in zip(recorded.results, results):
            np.testing.assert_array_equal(np.asarray(ran), again)
        assert [len(o.outputs[0].token_ids) for o in engine_outs] == [p.max_tokens for p in params]
        assert "step" not in vars(engine.core)  # the recorder put the method back
        recorded.dispatches += 1  # as if the run had also swapped: not all its device work
        with pytest.raises(ValueError, match="step programs"):
            replay(engine, recorded)
        assert_drained(llm)
