"""The rows of a step that sample: the LM head and the sampler run on those, not on every slot.

A step samples one token for each slot that decoded (its decode row) or completed its prompt
(the row of its last prompt token). The LM head and every vocabulary-wide sampling op
(log-normalizer, argmax, penalties, filters) run on those candidate rows only — the decode
bucket's rows plus one row per prompt block — so a step with 4 busy slots of 32 pays for 4
vocabulary rows, not 32 (on the 30-layer SmolLM2-135M shape, vocabulary 49 152, sampling 32
rows took ~7 ms of every step, 4 rows ~0.3 ms). Each row knows its slot; a row that samples
nothing (a padding decode row, a prompt block that completes nothing) has slot ``max_slots``,
so its results scatter nowhere (``mode="drop"``).

1. :func:`head_rows` picks the rows from the step's candidates (compacting them to ``max_slots``
   when a bucket has more candidates than slots: at most one sampling row per slot);
2. :func:`slot_index` / :func:`slot_view` gather each row's per-slot inputs (sampling
   parameters, step index, bitmask, penalty statistics) from the state;
3. :func:`to_slots` scatters per-row results back to one entry per slot for the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int32, Shaped


def head_rows(
    rows: Int32[Array, " h"], slots: Int32[Array, " h"], max_slots: int
) -> tuple[Int32[Array, " r"], Int32[Array, " r"]]:
    """``rows`` (token-buffer rows) with their ``slots`` (``max_slots``: samples nothing):
    all of them when there are at most ``max_slots``, else the sampling ones first, padded to
    ``max_slots`` (a fixed shape either way)."""
    h = rows.shape[0]
    if h <= max_slots:
        return rows, slots
    keep = jnp.nonzero(slots < max_slots, size=max_slots, fill_value=h)[0]  # [S]
    rows = jnp.append(rows, 0)[keep]  # the fill entry: row 0, sampling nothing
    return rows, jnp.append(slots, max_slots)[keep]


def slot_index(slots: Int32[Array, " r"], max_slots: int) -> Int32[Array, " r"]:
    """The slot each row reads its per-slot inputs from: its own, or the last slot for a row
    that samples nothing (its results are dropped)."""
    return jnp.minimum(slots, max_slots - 1)


def slot_view(tree, at: Int32[Array, " r"]):
    """Every per-slot array of ``tree`` (leading axis ``max_slots``) at ``at`` (from
    :func:`slot_index`): one entry per row."""
    return jax.tree.map(lambda a: a[at], tree)


def to_slots(tree, slots: Int32[Array, " r"], max_slots: int):
    """Per-row results as one entry per slot (zeros where no row sampled)."""

    def put(x: Shaped[Array, "rows ..."]) -> Shaped[Array, "slots ..."]:
        empty = jnp.zeros((max_slots, *x.shape[1:]), x.dtype)
        return empty.at[slots].set(x, mode="drop")

    return jax.tree.map(put, tree)
