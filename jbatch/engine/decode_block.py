"""Blocks of decode steps: several decode-only :func:`core.step` calls in one program.

With ``EngineConfig.decode_steps`` = N > 1 the engine's decode-only programs are
:func:`engine_block` (``buckets.runs_blocks``): release, insert, then up to N whole steps in a
``lax.fori_loop`` whose trip count is an input (``StepBatch.decode_steps``), so an engine with
blocks compiles no more programs than one without. Each step feeds back the token the previous
one sampled (the state's ``tokens``), and a slot stops where its token budget stops it (the
decode rule), so the host knows every slot's count when it plans the block
(``Scheduler.block_steps``). The result is one ``StepOutput.packed()`` row per step.
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
    ``batch`` in one program (``lax.fori_loop``): each a whole :func:`core.step` — the listed slots
    feed back the token the previous step sampled; a slot stops where ``decode_mask`` stops it
    (its token budget). The page writes must cover every position the block reaches (they
    are applied once per step: the same entries). Row ``i`` of the result is step ``i``'s
    ``StepOutput.packed()``; rows past the count are zeros. Sampling is the same as step by
    step: a slot's random stream is keyed by its token count, not by the step."""
    one = lambda st: step(params, st, batch, token_bitmask=token_bitmask, **forward_kwargs)
    width = jax.eval_shape(lambda st: one(st)[1].packed(), state).shape[0]

    def body(i, carry):
        st, rows = carry
        st, out = one(st)
        return st, jax.lax.dynamic_update_slice(rows, out.packed()[None], (i, 0))

    n = jnp.clip(batch.decode_steps[0], 1, max_steps)
    rows = jnp.zeros((max_steps, width), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (state, rows))


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
