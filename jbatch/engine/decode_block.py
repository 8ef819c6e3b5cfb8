"""Blocks of decode steps: several decode-only :func:`core.step` calls in one program.

With ``EngineConfig.decode_steps`` = N > 1 the engine's decode-only programs are
:func:`engine_block` (``buckets.runs_blocks``): release, insert, then up to N whole steps in a
loop whose trip count is an input (``StepBatch.decode_steps``), so an engine with blocks
compiles no more programs than one without. Each step feeds back the token the previous one
sampled (the state's ``tokens``), and a slot stops where its token budget stops it (the decode
rule), so the host knows every slot's count when it plans the block
(``Scheduler.block_steps``). The result is one ``StepOutput.packed()`` row per step.

An *admission block* (:func:`admission_block`; the programs with prompt rows and every slot's
decode row, ``buckets.runs_blocks``) is an ordinary step that prefills prompts run on as a
block (``MultiStepPlanning.admission_block``): its first step has the prompt rows, the later
ones are decode steps of the same slots, the newly admitted ones included, without them. Its
result is the first step's packed row, then the decode rows: every block program's layout.

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

from jbatch.engine.core import SlotInsert, StepBatch, StepOutput, insert, release, step
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
    n = jnp.clip(batch.decode_steps[0], 1, max_steps)
    stopped, idle = jnp.zeros(state.max_slots, bool), jnp.int32(0)
    return _steps(one, state, batch, n, max_steps, stopped, idle)


def _steps(one, state: EngineState, batch: StepBatch, n, max_steps: int, stopped, idle):
    """Up to ``n`` calls of ``one`` (a whole decode step) in a ``lax.while_loop``, ending early
    on stop tokens as :func:`decode_block` says; ``stopped``/``idle``: what earlier steps of
    the block left. Returns the state and ``[max_steps, width]`` rows (zeros past the end)."""
    width = jax.eval_shape(lambda st: one(st)[1].packed(), state).shape[0]
    budget = batch.block_idle_budget[0]

    def body(carry):
        i, st, rows, stopped, idle = carry
        st, out = one(st)
        stopped, idle = _stops(batch, st, out, stopped, idle)
        rows = jax.lax.dynamic_update_slice(rows, out.packed()[None], (i, 0))
        return i + 1, st, rows, stopped, idle

    def more(carry):
        i, _, _, _, idle = carry
        return (i < n) & (idle <= budget)

    rows = jnp.zeros((max_steps, width), jnp.int32)
    carry = (jnp.int32(0), state, rows, stopped, idle)
    _, state, rows, _, _ = jax.lax.while_loop(more, body, carry)
    return state, rows


def _stops(batch: StepBatch, st: EngineState, out: StepOutput, stopped, idle):
    """The slots done on a stop token after a step (``out``, ``st`` after it), and the idle
    slot-steps one more step would leave."""
    hit = (out.tokens[:, None] == batch.block_stop_tokens).any(axis=1) & out.sampled
    hit &= st.decode_mask  # one at its planned last token: the plan counted its idle rows
    stopped = stopped | hit
    return stopped, idle + stopped.sum(dtype=jnp.int32)


def admission_block(
    params: dict,
    state: EngineState,
    batch: StepBatch,
    *,
    max_steps: int,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    first_kwargs: dict | None = None,
    **forward_kwargs,
) -> tuple[EngineState, Int32[Array, " n"]]:
    """A step with prompt rows, then up to ``batch.decode_steps[0] - 1`` decode steps of the
    same slots (``decode_slots`` lists every slot the block decodes, the requests whose prompt
    the first step completes included: they decode from the second step on). ``first_kwargs``:
    forward keywords of the first step only (a packed prompt region's ``packed_rows``). The
    result is the first step's ``StepOutput.packed()`` followed by ``max_steps - 1`` decode
    rows (:func:`decode_block`'s; zeros past the steps it ran)."""
    state, first = step(
        params, state, batch, token_bitmask=token_bitmask, **forward_kwargs, **(first_kwargs or {})
    )
    decode = decode_only(batch)
    one = lambda st: step(params, st, decode, token_bitmask=token_bitmask, **forward_kwargs)
    stopped, idle = _stops(batch, state, first, jnp.zeros(state.max_slots, bool), jnp.int32(0))
    n = jnp.clip(batch.decode_steps[0], 1, max_steps) - 1
    state, rows = _steps(one, state, decode, n, max_steps - 1, stopped, idle)
    return state, jnp.concatenate([first.packed(), rows.ravel()])


def decode_only(batch: StepBatch) -> StepBatch:
    """``batch`` without its prompt rows: the decode steps after an admission block's first."""
    none = lambda a: a[:0]
    return batch.replace(
        prefill_tokens=none(batch.prefill_tokens),
        prefill_slots=none(batch.prefill_slots),
        prefill_positions=none(batch.prefill_positions),
        prefill_targets=none(batch.prefill_targets),
    )


def engine_block(
    params: dict,
    state: EngineState,
    release_mask: Bool[Array, " slots"],
    ins: SlotInsert,
    batch: StepBatch,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    *,
    max_steps: int,
    first_kwargs: dict | None = None,
    **step_kwargs,
) -> tuple[EngineState, Int32[Array, " n"]]:
    """``core.engine_step`` for a block of steps: release, insert, then :func:`decode_block`
    (a decode-only batch) or :func:`admission_block` (one with prompt rows). The result is
    flat: the first step's packed row, then ``max_steps - 1`` decode rows (the programs of
    ``buckets.runs_blocks``)."""
    state = insert(release(state, release_mask), ins)
    if batch.prefill_tokens.shape[0] == 0:
        state, rows = decode_block(
            params, state, batch, max_steps=max_steps, token_bitmask=token_bitmask, **step_kwargs
        )
        return state, rows.ravel()
    return admission_block(
        params, state, batch, max_steps=max_steps, token_bitmask=token_bitmask,
        first_kwargs=first_kwargs, **step_kwargs,
    )  # fmt: skip
