"""A speculative dispatch: up to ``decode_steps`` speculative steps in one program.

With ``EngineConfig.decode_steps`` = N > 1 a speculating engine runs up to N whole
:func:`spec_step.spec_step` calls per dispatch (``SpecBatch.steps``, planned by
``Scheduler.block_steps``), so the launch, the planning and the result reading are paid once per
block, as for blocks of decode steps (``decode_block.py``). With N = 1 it is one step, no loop.

1. Each group's n-gram stream is assembled once (``spec_step.ngram_stream``) and grows on the
   device: after each step the tokens it emitted are appended, so the next step looks up the
   real continuation (what the host would only learn after the block).
2. A group emits at most ``max_drafts`` + 1 tokens in the dispatch (the host gave it pages for
   that many): step by step its proposals are capped by what is left (``spec_step.group_live``
   stops it once none is), a group that does not propose decodes one token a step.
3. The loop ends after ``steps`` steps or when no group decodes any more (all hit their token
   budget or their pages).
4. The tokens each group emitted, all but its last (which is the slot's ``tokens``), are kept in
   ``EngineState.spec_emitted``: the next dispatch, planned while this one runs, completes the
   stream the host sent with them.

The result is one ``pack_spec`` row per step (zeros past the last), read by the host as a
``[steps, groups, K + 1]`` run (``speculator.emitted``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int32

from jbatch.engine.core import SlotInsert, insert, release
from jbatch.engine.spec_step import SpecBatch, group_live, ngram_stream, pack_spec, spec_step
from jbatch.engine.state import EngineState


def spec_block(
    params: dict,
    state: EngineState,
    batch: SpecBatch,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    *,
    max_steps: int,
    num_speculative_tokens: int,
    **step_kwargs,
) -> tuple[EngineState, Int32[Array, "max_steps n"]]:
    """``batch.steps[0]`` (clipped to ``1..max_steps``) speculative steps (module doc)."""
    s, g, k1 = state.max_slots, batch.group_slots.shape[0], num_speculative_tokens + 1
    gs_c = jnp.clip(batch.group_slots, 0, s - 1)
    rows_g = jnp.arange(g, dtype=jnp.int32)[:, None]
    j = jnp.arange(k1, dtype=jnp.int32)[None, :]
    start = state.seq_lens[gs_c]
    ngram = state.spec_emitted is not None  # else a draft model proposes
    kept = state.spec_emitted.shape[1] if ngram else 0
    stream = ngram_stream(state, batch, gs_c) if ngram else None
    if ngram and max_steps > 1:  # room for the block's tokens (module doc, 1)
        stream = (jnp.pad(stream[0], ((0, 0), (0, (max_steps - 1) * k1))), stream[1])

    def run(st, stream):
        used = st.seq_lens[gs_c] - start
        st, out, spec = spec_step(
            params, st, batch, token_bitmask, used=used, stream=stream,
            num_speculative_tokens=num_speculative_tokens, **step_kwargs,
        )  # fmt: skip
        return used, st, spec, pack_spec(out, spec)

    def one(i, st, stream, emitted, rows):
        used, st, spec, row = run(st, stream)
        on = j < spec.count[:, None]  # [G, K1]: the tokens this step emitted
        if ngram:  # module doc, 1 and 4
            at = jnp.where(on, used[:, None] + j, kept)
            emitted = emitted.at[rows_g, at].set(spec.tokens, mode="drop")
            tokens, length = stream
            at = jnp.where(on, length[:, None] + j, tokens.shape[1])
            stream = tokens.at[rows_g, at].set(spec.tokens, mode="drop"), length + spec.count
        rows = jax.lax.dynamic_update_slice(rows, row[None], (i, 0))
        return i + 1, st, stream, emitted, rows

    width = jax.eval_shape(lambda st: run(st, stream)[3], state).shape[0]
    rows = jnp.zeros((max_steps, width), jnp.int32)
    carry = (jnp.int32(0), state, stream, jnp.zeros((g, kept), jnp.int32), rows)
    if max_steps == 1:
        carry = one(*carry)
    else:
        n = jnp.clip(batch.steps[0], 1, max_steps)

        def going(carry):
            i, st = carry[0], carry[1]
            return (i < n) & jnp.any(group_live(st, batch, st.seq_lens[gs_c] - start))

        carry = jax.lax.while_loop(going, lambda c: one(*c), carry)
    _, state, _, emitted, rows = carry
    if ngram:  # module doc, 4
        ran = state.seq_lens[gs_c] > start
        target = jnp.where(ran & (batch.group_slots < s), batch.group_slots, s)
        state = state.replace(spec_emitted=state.spec_emitted.at[target].set(emitted, mode="drop"))
    return state, rows


def engine_spec_block(
    params: dict,
    state: EngineState,
    release_mask: Bool[Array, " slots"],
    ins: SlotInsert,
    batch: SpecBatch,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    **block_kwargs,
) -> tuple[EngineState, Int32[Array, "max_steps n"]]:
    """Release, insert (as ``core.engine_step``), then :func:`spec_block`."""
    state = insert(release(state, release_mask), ins)
    return spec_block(params, state, batch, token_bitmask, **block_kwargs)
