"""Blocks of decode steps: several decode-only :func:`core.step` calls in one program.

With ``EngineConfig.decode_steps`` = N > 1 the engine's decode-only programs are
:func:`engine_block` (``buckets.runs_blocks``): release, insert, then up to N whole steps in a
loop whose trip count is an input (``StepBatch.decode_steps``), so an engine with blocks
compiles no more programs than one without. Each step feeds back the token the previous one
sampled (the state's ``tokens``), and a slot stops where its token budget stops it (the decode
rule), so the host knows every slot's count when it plans the block
(``Scheduler.block_steps``). The result is one ``StepOutput.packed()`` row per step.

A request that may stop on a token (EOS, ``stop_token_ids``) is the one thing the host cannot
plan for. While requests queue, its block carries those ids and an idle budget (what the plan
leaves of ``multi_step_planning.BLOCK_IDLE_STEPS`` steps' worth of slot rows): the device
ends the block before its count once the slots that sampled a stop token would idle more than
that, and the host, which finds the steps it ran from the sampled flags, gives back the tokens
it had planned past them (``Scheduler.block_cut``) and reads the result before planning
again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int32

from jbatch.engine.core import SlotInsert, StepBatch, insert, release, step
from jbatch.engine.state import EngineState


def decode_block(
    params: dict,
    state: EngineState,
    batch: StepBatch,
    *,
    max_steps: int,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    **forward_kwargs,
) -> tuple[EngineState, Int32[Array, "max_steps n"]]:
    """``batch.decode_steps[0]`` (clipped to ``1..max_steps``) decode steps of a decode-only
    ``batch`` in one program (``lax.while_loop``): each a whole :func:`core.step` — the listed
    slots feed back the token the previous step sampled; a slot stops where ``decode_mask``
    stops it (its token budget). The page writes must cover every position the block reaches
    (they are applied once per step: the same entries). Row ``i`` of the result is step ``i``'s
    ``StepOutput.packed()``; rows past the steps it ran are zeros. Sampling is the same as
    step by step: a slot's random stream is keyed by its token count, not by the step.

    It ends early where the slots that sampled one of their ``batch.block_stop_tokens`` (they
    are done, but the device cannot tell which other stop the host applies) would leave more
    than ``batch.block_idle_budget[0]`` slot-steps idle: one step after a stop, each stopped
    slot idles a step per further step."""
    one = lambda st: step(params, st, batch, token_bitmask=token_bitmask, **forward_kwargs)
    width = jax.eval_shape(lambda st: one(st)[1].packed(), state).shape[0]
    n = jnp.clip(batch.decode_steps[0], 1, max_steps)
    budget = batch.block_idle_budget[0]

    def body(carry):
        i, st, rows, stopped, idle = carry
        st, out = one(st)
        hit = (out.tokens[:, None] == batch.block_stop_tokens).any(axis=1) & out.sampled
        hit &= st.decode_mask  # one at its planned last token: the plan counted its idle rows
        stopped = stopped | hit
        idle = idle + stopped.sum(dtype=jnp.int32)  # what one more step would leave idle
        rows = jax.lax.dynamic_update_slice(rows, out.packed()[None], (i, 0))
        return i + 1, st, rows, stopped, idle

    def more(carry):
        i, _, _, _, idle = carry
        return (i < n) & (idle <= budget)

    rows = jnp.zeros((max_steps, width), jnp.int32)
    stopped = jnp.zeros(state.max_slots, bool)
    carry = (jnp.int32(0), state, rows, stopped, jnp.int32(0))
    _, state, rows, _, _ = jax.lax.while_loop(more, body, carry)
    return state, rows


def engine_block(
    params: dict,
    state: EngineState,
    release_mask: Bool[Array, " slots"],
    ins: SlotInsert,
    batch: StepBatch,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    *,
    max_steps: int,
    **step_kwargs,
) -> tuple[EngineState, Int32[Array, "max_steps n"]]:
    """``core.engine_step`` for a block of decode steps: release, insert, then
    :func:`decode_block` (the decode-only programs of an engine with ``decode_steps`` > 1)."""
    state = insert(release(state, release_mask), ins)
    return decode_block(
        params, state, batch, max_steps=max_steps, token_bitmask=token_bitmask, **step_kwargs
    )
