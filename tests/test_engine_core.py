"""The device API used directly: init/insert/step/release inside the user's own jit and scan."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jbatch import LLM, SamplingParams
from jbatch.checkpoint import load_model
from jbatch.engine import sampling_rows
from jbatch.engine.config import EngineConfig
from jbatch.engine.core import StepBatch, insert, insert_one, prompt_batch, release, step
from jbatch.engine.state import init_state

CFG = EngineConfig(
    max_slots=2, page_size=8, num_pages=16, max_num_batched_tokens=32, max_seq_len=64, block_q=16
)


def test_scan_of_steps_inside_user_jit_matches_llm(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    model_cfg, params = load_model(path)
    prompt = [5, 9, 33, 120, 7, 64, 3, 250, 11]
    num_new = 10
    step_fn = functools.partial(step, model_cfg=model_cfg, block_q=CFG.block_q)

    @jax.jit
    def generate(params, first: StepBatch, decode: StepBatch):
        state = init_state(model_cfg, CFG)
        state = insert(state, insert_one(CFG, 1, len(prompt), num_new))
        state, out = step_fn(params, state, first)  # prefill; samples the first token

        def body(state, _):
            state, o = step_fn(params, state, decode)
            return state, o.tokens[1]

        state, rest = jax.lax.scan(body, state, length=num_new - 1)
        state = release(state, jnp.arange(CFG.max_slots) == 1)
        return jnp.concatenate([out.tokens[1:2], rest]), state

    pages = [3, 12, 6]  # positions 0..17 need 3 pages of 8; any free pages, in any order
    tokens, state = generate(params, prompt_batch(CFG, 1, prompt, pages), StepBatch.empty(CFG))
    assert not bool(state.active[1]) and int(state.num_generated[1]) == num_new
    assert int(state.seq_lens[1]) == len(prompt) + num_new - 1

    llm = LLM(
        path,
        max_slots=2,
        page_size=8,
        num_pages=16,
        max_num_batched_tokens=32,
        max_seq_len=64,
        block_q=16,
    )
    want = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True), use_tqdm=False
    )
    np.testing.assert_array_equal(np.asarray(tokens), want[0].outputs[0].token_ids)


def test_head_rows_keep_every_sampling_row_when_a_bucket_has_more_rows_than_slots():
    s = 4
    rows = jnp.arange(7, dtype=jnp.int32) * 10
    slots = jnp.asarray([s, 2, s, 0, s, 3, s], jnp.int32)  # 3 rows sample, 4 sample nothing
    got_rows, got_slots = sampling_rows.head_rows(rows, slots, s)
    assert got_rows.shape == (s,)
    np.testing.assert_array_equal(np.asarray(got_slots), [2, 0, 3, s])
    np.testing.assert_array_equal(np.asarray(got_rows)[:3], [10, 30, 50])
    few = sampling_rows.head_rows(rows[:3], slots[:3], s)  # fewer candidates than slots: as is
    np.testing.assert_array_equal(np.asarray(few[1]), [s, 2, s])
    out = sampling_rows.to_slots(jnp.asarray([7, 8, 9, 1]), got_slots, s)
    np.testing.assert_array_equal(np.asarray(out), [8, 0, 7, 9])


def test_prompt_batch_lists_every_slot_or_none_on_a_prefill_engine():
    """``prompt_batch`` lists every slot to decode beside the prompt (its bucket's full decode
    rows); a prefill engine compiles no decode rows, so it lists none."""
    batch = prompt_batch(CFG, 1, [5, 9, 33], [3])
    assert batch.decode_slots.tolist() == [0, 1] and len(batch.prefill_tokens) == 16
    prefill = dataclasses.replace(CFG, role="prefill")
    assert prompt_batch(prefill, 1, [5, 9, 33], [3]).decode_slots.shape == (0,)
