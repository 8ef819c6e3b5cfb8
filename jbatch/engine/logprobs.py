"""Top-k logprobs on the device: for sampled tokens and for prompt tokens (fixed shapes).

Every step program returns, besides the sampled tokens, a :class:`TopLogprobs` row per slot
and one per prompt-chunk row (``K = MAX_LOGPROBS`` candidates each, whatever a request asked
for: the host keeps the first k). Values are ``log_softmax`` of the raw model's logits — the
distribution of the chosen-token logprob the sampler returns (same normaliser,
``sampler.log_normalizer``) — highest first, ties by lower token id (``lax.top_k``'s order).

Both are computed only when the step needs them (otherwise zeros):

- sampled tokens (a ``lax.cond``): when some slot's ``want`` flag is set (the host sets it for
  the slots of requests with ``logprobs``);
- prompt tokens: when some prompt row has a ``target`` (the next prompt token, ``-1``: none).
  The LM head then runs on the prompt rows too — on the blocks of rows that have a target
  only, in a loop whose trip count is 0 when none has — which a step without prompt logprobs
  never does (it runs the head on one row per prompt block only).

:func:`pack` lays both out as int32 (floats bit for bit) after the step's ``[3, slots]``
tokens / sampled / logprob rows; :func:`unpack` is the host side.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int32

from jbatch.engine.sampler import log_normalizer
from jbatch.sampling_params import MAX_LOGPROBS

K = MAX_LOGPROBS  # candidates computed per row (fixed: one program serves every request)
HEAD_BLOCK = 64  # prompt rows per LM-head call on the prompt-logprob path (bounds memory)


@struct.dataclass
class TopLogprobs:
    """Per row: one token's logprob and rank (1 = most likely), and the ``K`` most likely
    tokens with their logprobs, highest first."""

    logprob: Float[Array, " n"]
    rank: Int32[Array, " n"]
    ids: Int32[Array, "n k"]
    values: Float[Array, "n k"]

    @classmethod
    def zeros(cls, n: int) -> TopLogprobs:
        return cls(
            jnp.zeros((n,), jnp.float32),
            jnp.zeros((n,), jnp.int32),
            jnp.zeros((n, K), jnp.int32),
            jnp.zeros((n, K), jnp.float32),
        )


def top_logprobs(logits: Float[Array, "n vocab"], token: Int32[Array, " n"]) -> TopLogprobs:
    """``token``'s logprob and rank, and the top ``K``, of each row of ``log_softmax(logits)``."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[1]
    lse = log_normalizer(logits)  # [n]
    values, ids = jax.lax.top_k(logits, min(K, vocab))  # [n, k] highest first, ties: lower id
    if vocab < K:  # tiny vocabularies: pad to the fixed width
        values = jnp.pad(values, ((0, 0), (0, K - vocab)), constant_values=-jnp.inf)
        ids = jnp.pad(ids, ((0, 0), (0, K - vocab)), constant_values=-1)
    own = jnp.take_along_axis(logits, token[:, None], axis=-1)  # [n, 1]
    rank = 1 + jnp.sum(logits > own, axis=-1, dtype=jnp.int32)  # [n]
    finite = lambda x: jnp.where(jnp.isnan(x), -jnp.inf, x)
    return TopLogprobs(finite(own[:, 0] - lse), rank, ids, finite(values - lse[:, None]))


def sampled_top_logprobs(
    logits: Float[Array, "n vocab"],
    tokens: Int32[Array, " n"],
    want: Bool[Array, " n"],
    place: Callable[[TopLogprobs], TopLogprobs] | None = None,
    out_rows: int | None = None,
) -> TopLogprobs:
    """:func:`top_logprobs` of the sampled tokens, computed only when some row wants them.
    ``place`` maps the rows' result to ``out_rows`` output rows (the engine: its sampling rows
    to one row per slot), inside the conditional; otherwise zeros are all that is written."""
    place = (lambda top: top) if place is None else place
    n = logits.shape[0] if out_rows is None else out_rows
    return jax.lax.cond(
        jnp.any(want),
        lambda: place(top_logprobs(logits, tokens)),
        lambda: TopLogprobs.zeros(n),
    )


def prompt_top_logprobs(
    head: Callable[[Float[Array, "b e"]], Float[Array, "b vocab"]],
    hidden: Float[Array, "rows e"],
    targets: Int32[Array, " rows"],
    block_q: int,
) -> TopLogprobs:
    """Per prompt row: ``targets``' logprob (the next prompt token, given the row's prefix) and
    the top ``K``; zeros for rows whose target is ``-1``. ``head`` is the LM head (hidden ->
    float32 logits); it runs only on the blocks of rows that have a target: a loop over those
    blocks, whose trip count is 0 when no row has one. (A ``lax.cond`` would do the same, but
    XLA CPU pays ~3 ms per step for a conditional that takes the LM head as an operand, even
    when it is false; the loop costs ~0.3 ms at a 256-row bucket, measured.)"""
    rows, e = hidden.shape
    if rows == 0:
        return TopLogprobs.zeros(0)
    block = min(rows, HEAD_BLOCK) if rows % HEAD_BLOCK == 0 else block_q
    nb = rows // block
    # One padding block (and one padding entry of ``todo``): with a single block, the block
    # index would be a constant, and XLA would hoist the whole body out of the loop — running
    # it on every step, even for 0 trips (measured: 90 ms per 16-row step on XLA CPU).
    h_blocks = jnp.pad(hidden, ((0, block), (0, 0))).reshape(nb + 1, block, e)
    t_blocks = jnp.pad(targets, (0, block), constant_values=-1).reshape(nb + 1, block)
    asked = jnp.any(t_blocks >= 0, axis=1)  # [NB + 1]
    todo = jnp.nonzero(asked, size=nb + 1, fill_value=nb)[0]  # [NB + 1] blocks that ask first

    def body(i, out: TopLogprobs) -> TopLogprobs:
        b = todo[i]
        h = jax.lax.dynamic_index_in_dim(h_blocks, b, keepdims=False)  # [B, E]
        t = jax.lax.dynamic_index_in_dim(t_blocks, b, keepdims=False)  # [B]
        got = top_logprobs(head(h), jnp.maximum(t, 0))
        put = lambda o, x: jax.lax.dynamic_update_slice_in_dim(o, x, b * block, axis=0)
        return jax.tree.map(put, out, got)

    out = jax.lax.fori_loop(0, jnp.sum(asked), body, TopLogprobs.zeros(rows + block))
    return jax.tree.map(lambda a: a[:rows], out)


def _bits(x: Float[Array, "*s"]) -> Int32[Array, "*s"]:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def pack(
    head: Int32[Array, "3 slots"], sampled: TopLogprobs, prompt: TopLogprobs
) -> Int32[Array, " n"]:
    """One flat int32 array: ``head`` (tokens, sampled flags, logprob bits), then per slot
    ``[rank, K ids, K logprob bits]``, then per prompt row ``[logprob bits, rank, K ids, K
    logprob bits]``."""
    per_slot = jnp.concatenate(
        [sampled.rank[:, None], sampled.ids, _bits(sampled.values)], axis=1
    )  # [S, 1 + 2K]
    per_row = jnp.concatenate(
        [_bits(prompt.logprob)[:, None], prompt.rank[:, None], prompt.ids, _bits(prompt.values)],
        axis=1,
    )  # [R, 2 + 2K]
    return jnp.concatenate([head.reshape(-1), per_slot.reshape(-1), per_row.reshape(-1)])


def packed_width(slots: int, prompt_rows: int = 0) -> int:
    """The length of :func:`pack`'s result for ``slots`` slots and ``prompt_rows`` rows."""
    return 3 * slots + slots * (1 + 2 * K) + prompt_rows * (2 + 2 * K)


class HostTopLogprobs:
    """Host view (numpy) of a :class:`TopLogprobs` block of a packed result."""

    def __init__(self, logprob: np.ndarray | None, rank, ids, values):
        self.logprob, self.rank, self.ids, self.values = logprob, rank, ids, values

    def row(self, i: int) -> tuple[int, list[int], list[float]]:
        """(rank, top ids, top logprobs) of row ``i``."""
        return int(self.rank[i]), self.ids[i].tolist(), self.values[i].tolist()


def unpack(packed: np.ndarray, slots: int):
    """Host side of :func:`pack`: ``(head [3, S], sampled, prompt)`` (numpy views)."""
    packed = np.asarray(packed)
    head = packed[: 3 * slots].reshape(3, slots)
    at = 3 * slots
    per_slot = packed[at : at + slots * (1 + 2 * K)].reshape(slots, 1 + 2 * K)
    per_row = packed[at + slots * (1 + 2 * K) :].reshape(-1, 2 + 2 * K)
    f32 = lambda a: a.view(np.float32)
    top_ids, top_values = per_slot[:, 1 : 1 + K], f32(per_slot[:, 1 + K :])
    sampled = HostTopLogprobs(None, per_slot[:, 0], top_ids, top_values)
    prompt = HostTopLogprobs(
        f32(per_row[:, 0]), per_row[:, 1], per_row[:, 2 : 2 + K], f32(per_row[:, 2 + K :])
    )
    return head, sampled, prompt
