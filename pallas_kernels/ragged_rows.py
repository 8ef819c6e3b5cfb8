"""Engine rows -> ragged sequences: the packing both ragged kernels (GPU, TPU) take.

The engine's flat batch groups rows into **entries** (contiguous runs of rows; entry
``row_entry[t]``, each one sequence reading ``entry_tables[e]``). An entry's valid rows
(position >= 0) are its last tokens in order; padding rows may sit anywhere. A ragged kernel wants
the valid rows packed to the front, entry after entry, with per-entry query counts and context
lengths: :func:`pack_rows` computes that (stable), :func:`unpack_rows` puts results back (padding
rows: zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int


@struct.dataclass
class PackedRows:
    dest: Int[Array, " t"]  # packed row of each valid row (garbage for padding rows)
    valid: Bool[Array, " t"]
    seq_lens: Int[Array, " e"]  # context length of each entry (0: an entry of padding only)
    query_starts: Int[Array, " e_plus_1"]  # packed rows of entry e: [starts[e], starts[e + 1])

    def pack(self, q: Float[Array, "t h d"]) -> Float[Array, "t h d"]:
        """Valid rows moved to the front (rest zeros)."""
        t = q.shape[0]
        return jnp.zeros_like(q).at[jnp.where(self.valid, self.dest, t)].set(q, mode="drop")

    def unpack(self, out: Float[Array, "t h d"], dtype) -> Float[Array, "t h d"]:
        """A packed result back at the rows' places; padding rows are zeros."""
        t = out.shape[0]
        back = out[jnp.clip(self.dest, 0, t - 1)]
        return jnp.where(self.valid[:, None, None], back, 0).astype(dtype)


def pack_rows(row_entry: Int[Array, " t"], positions: Int[Array, " t"], num_entries: int):
    """The :class:`PackedRows` of a flat batch with ``num_entries`` entries."""
    valid = positions >= 0
    qlen = jax.ops.segment_sum(valid.astype(jnp.int32), row_entry, num_entries)  # [E]
    seq_lens = jnp.maximum(jax.ops.segment_max(positions, row_entry, num_entries) + 1, 0)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(qlen)]).astype(jnp.int32)
    dest = (jnp.cumsum(valid) - 1).astype(jnp.int32)
    return PackedRows(dest=dest, valid=valid, seq_lens=seq_lens.astype(jnp.int32),
                      query_starts=starts)  # fmt: skip
