"""Pure-JAX paged attention over query blocks: the oracle every faster path is tested against.

Vocabulary shared by every implementation in this package:

* **KV pool** (one layer): ``k_pages, v_pages: [P, S, KVH, D]`` (pages, page size, KV heads,
  head dim). A page is one contiguous ``S x KVH x D`` block: gathering a sequence's pages yields
  its keys as ``[tokens, KVH, D]`` with no transpose, a token's K/V write is one contiguous row,
  and a GPU kernel loads whole pages for all heads of a GQA group (the layout of vLLM's flash
  attention cache and of JAX's TPU ragged paged attention). Tensor parallelism shards axis 2.
* **Query blocks**: ``q: [N, Bq, H, D]`` — N blocks of Bq query rows; every row of a block belongs
  to the same sequence. Decode tokens are blocks of one row (Bq = 1); a prompt chunk is split into
  blocks of Bq rows. A block reads its sequence's pages through ``block_tables: [N, max_pages]``.
* **Positions**: ``q_positions: [N, Bq]``, the absolute position of each query row, -1 for padding.
  Key ``c`` is visible to a query at position ``p`` iff ``c <= p`` (causal) and, with a sliding
  window ``w``, ``c > p - w``. K/V of the query tokens themselves must already be in the pool.

* **8-bit pools** (optional ``k_scales, v_scales: [P, S, KVH]``, see
  :mod:`pallas_kernels.kv_quant`): ``k_pages``/``v_pages`` hold int8 or float8 entries and each
  path dequantizes what it gathers, to the query's dtype — the result is that of a float pool
  holding the dequantized values.

Padding rows return zeros. Pool entries past a block's last query position are never read into a
result, even when they hold NaN (free or recycled pages): they are masked before the softmax *and*
zeroed before the value product, since 0 * NaN = NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.kv_quant import dequantize

_NEG = -1e30  # finite "minus infinity": keeps exp() and max() NaN-free on fully masked rows


def key_mask(
    q_positions: Int[Array, "n bq"],
    key_positions: Int[Array, " c"] | Int[Array, "n c"],
    sliding_window: int | None,
) -> Array:
    """[N, Bq, C] boolean: which keys each query row may attend to. ``key_positions``: the
    same keys for every block, or each block's own ([N, C])."""
    qp = q_positions[:, :, None]  # [N, Bq, 1]
    kp = key_positions[None, None, :] if key_positions.ndim == 1 else key_positions[:, None, :]
    mask = (kp <= qp) & (qp >= 0)
    if sliding_window is not None:
        mask &= kp > qp - sliding_window
    return mask


def gather_pages(
    pages: Shaped[Array, "p s *rest"], block_tables: Int[Array, "n mp"]
) -> Shaped[Array, "n c *rest"]:
    """Gather each block's pages into one contiguous [N, max_pages * S, KVH, D] key/value run
    (or [N, max_pages * S, KVH] of scales)."""
    num_pages, page_size, *rest = pages.shape
    n, mp = block_tables.shape
    idx = jnp.clip(block_tables, 0, num_pages - 1)
    return pages[idx].reshape(n, mp * page_size, *rest)  # [N, MP, S, ...] -> [N, C, ...]


def gather_kv(
    pages: Shaped[Array, "p s kvh d"],
    scales: Float[Array, "p s kvh"] | None,
    block_tables: Int[Array, "n mp"],
    dtype,
) -> Float[Array, "n c kvh d"]:
    """:func:`gather_pages`, dequantized to ``dtype`` when the pool is 8-bit (``scales``)."""
    out = gather_pages(pages, block_tables)
    if scales is None:
        return out
    return dequantize(out, gather_pages(scales, block_tables), dtype)


def paged_attention_reference(
    q: Float[Array, "n bq h d"],
    k_pages: Shaped[Array, "p s kvh d"],
    v_pages: Shaped[Array, "p s kvh d"],
    block_tables: Int[Array, "n mp"],
    q_positions: Int[Array, "n bq"],
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    k_scales: Float[Array, "p s kvh"] | None = None,
    v_scales: Float[Array, "p s kvh"] | None = None,
) -> Float[Array, "n bq h d"]:
    """Attention of query blocks over their sequences' whole page lists (plainly correct, slow).

    ``soft_cap`` (Gemma-2 style) squashes logits to ``cap * tanh(logit / cap)`` before masking."""
    n, bq, h, d = q.shape
    kvh = k_pages.shape[2]
    g = h // kvh
    scale = d**-0.5 if scale is None else scale
    k = gather_kv(k_pages, k_scales, block_tables, q.dtype)  # [N, C, KVH, D]
    v = gather_kv(v_pages, v_scales, block_tables, q.dtype)  # [N, C, KVH, D]
    c = k.shape[1]
    kpos = jnp.arange(c, dtype=jnp.int32)
    mask = key_mask(q_positions, kpos, sliding_window)  # [N, Bq, C]
    # Keys past the block's last query were never written for this sequence: zero them.
    live = kpos[None, :] <= jnp.max(q_positions, axis=1)[:, None]  # [N, C]
    k = jnp.where(live[:, :, None, None], k, 0)
    v = jnp.where(live[:, :, None, None], v, 0)
    qg = q.reshape(n, bq, kvh, g, d).astype(jnp.float32)  # [N, Bq, KVH, G, D]
    s = jnp.einsum("nbkgd,nckd->nkgbc", qg, k.astype(jnp.float32)) * scale  # [N, KVH, G, Bq, C]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask[:, None, None], s, _NEG)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, None], jnp.exp(s - m), 0.0)
    denom = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("nkgbc,nckd->nbkgd", p / denom, v.astype(jnp.float32))  # [N, Bq, KVH, G, D]
    return o.reshape(n, bq, h, d).astype(q.dtype)
