"""Paged attention in plain XLA that stops at the longest live context (the CPU / fallback path).

Same contract as :func:`paged_attention_reference` (see that module for the layout). Instead of
gathering every block's whole page list, it walks the page tables in chunks of about
``chunk_tokens`` keys with an online (flash-style) softmax inside a ``lax.while_loop`` whose
trip count is *traced*: ceil(longest live context / chunk). A step whose sequences are short only
gathers their few pages, and the context length never enters a shape, so it never recompiles.

Decode rows (blocks of one query) are balanced instead (:func:`_attend_rows`): each loop
iteration takes the next ``2 n`` (row, chunk) pairs that hold live keys, whichever rows they
belong to, and merges each row's pairs into its online softmax. The trip count is the live
chunks of *all* rows over ``2 n``, so one long request no longer makes every decode row walk
its length, with no ``lax.cond`` (whose two branches every decode bucket compiled). Measured
(CPU, 6/2 heads, head dim 32, median of 200, two runs): 8 rows, one at 2 000 keys and seven
at 60, 0.30-0.32x the time; one at 500 and seven at 40, 0.35-0.44x; 32 rows of mixed lengths
0.70-0.77x; rows of equal length 1.0-1.23x (the pairs' bookkeeping).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.paged_attention_reference import _NEG, gather_kv, key_mask

# Decode rows: (row, chunk) pairs per loop iteration, per row of the call. 2 (measured, CPU,
# decode rows of 8-32 rows): one long row among short ones 0.30-0.44x the time of walking
# every row to the longest, equal lengths 1.0-1.23x (the pairs' bookkeeping); 1 and 4 worse.
PAIRS_PER_ROW = 2


def paged_attention_xla(
    q: Float[Array, "n bq h d"],
    k_pages: Shaped[Array, "p s kvh d"],
    v_pages: Shaped[Array, "p s kvh d"],
    block_tables: Int[Array, "n mp"],
    q_positions: Int[Array, "n bq"],
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    chunk_tokens: int = 64,
    k_scales: Float[Array, "p s kvh"] | None = None,
    v_scales: Float[Array, "p s kvh"] | None = None,
) -> Float[Array, "n bq h d"]:
    """8-bit pools (``k_scales``/``v_scales``) are dequantized chunk by chunk, after the gather:
    only the chunk's pages are ever widened, never the pool."""
    pool = (k_pages, v_pages, k_scales, v_scales)
    if q.shape[1] == 1:  # decode rows: blocks of one
        return _attend_rows(
            q, pool, block_tables, q_positions, sliding_window, scale, soft_cap, chunk_tokens
        )
    return _attend(
        q, pool, block_tables, q_positions, sliding_window, scale, soft_cap, chunk_tokens
    )


def _chunks(block_tables, page_size: int, chunk_tokens: int):
    """The walk's chunks: the page tables padded to whole chunks, pages per chunk, the number
    of chunks, keys per chunk."""
    mp = block_tables.shape[1]
    cp = max(1, min(chunk_tokens // page_size, mp))  # pages per chunk
    chunks = -(-mp // cp)
    tables = jnp.pad(block_tables, ((0, 0), (0, chunks * cp - mp)))  # [N, chunks * CP]
    return tables, cp, chunks, cp * page_size


def _attend(q, pool, block_tables, q_positions, sliding_window, scale, soft_cap, chunk_tokens):
    k_pages, v_pages, k_scales, v_scales = pool
    n, bq, h, d = q.shape
    kvh = k_pages.shape[2]
    g = h // kvh
    scale = d**-0.5 if scale is None else scale
    tables, cp, num_chunks_static, chunk_len = _chunks(block_tables, k_pages.shape[1], chunk_tokens)

    block_last = jnp.max(q_positions, axis=1)  # [N] last query position per block (-1: padding)
    live_len = jnp.max(block_last) + 1  # longest live context in this call
    num_chunks = jnp.clip((live_len + chunk_len - 1) // chunk_len, 0, num_chunks_static)
    # Sliding window: skip chunks entirely before every block's window.
    first_chunk = jnp.int32(0)
    if sliding_window is not None:
        valid_first = jnp.where(q_positions >= 0, q_positions, jnp.iinfo(jnp.int32).max)
        lowest = jnp.min(valid_first) - sliding_window + 1
        first_chunk = jnp.clip(lowest // chunk_len, 0, num_chunks_static).astype(jnp.int32)

    qg = q.reshape(n, bq, kvh, g, d).astype(jnp.float32) * scale  # [N, Bq, KVH, G, D]

    def body(carry):
        i, m, l_sum, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, i * cp, cp, axis=1)  # [N, CP]
        k = gather_kv(k_pages, k_scales, pages, q.dtype)  # [N, CL, KVH, D]
        v = gather_kv(v_pages, v_scales, pages, q.dtype)
        kpos = i * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [CL]
        live = kpos[None, :] <= block_last[:, None]  # [N, CL]
        # Garbage (even NaN) in K past the context only reaches masked scores, which ``where``
        # replaces; V must be zeroed there, since 0 x NaN would reach the output.
        v = jnp.where(live[:, :, None, None], v, 0).astype(jnp.float32)
        mask = key_mask(q_positions, kpos, sliding_window)[:, None, None]  # [N, 1, 1, Bq, CL]
        s = jnp.einsum("nbkgd,nckd->nkgbc", qg, k.astype(jnp.float32))  # [N, KVH, G, Bq, CL]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [N, KVH, G, Bq]
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l_sum = alpha * l_sum + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("nkgbc,nckd->nkgbd", p, v)
        return i + 1, m_new, l_sum, acc

    init = (
        first_chunk,
        jnp.full((n, kvh, g, bq), _NEG, jnp.float32),
        jnp.zeros((n, kvh, g, bq), jnp.float32),
        jnp.zeros((n, kvh, g, bq, d), jnp.float32),
    )
    _, _, l_sum, acc = jax.lax.while_loop(lambda c: c[0] < num_chunks, body, init)
    o = acc / jnp.maximum(l_sum, 1e-30)[..., None]  # [N, KVH, G, Bq, D]
    return o.transpose(0, 3, 1, 2, 4).reshape(n, bq, h, d).astype(q.dtype)


def _attend_rows(q, pool, block_tables, q_positions, sliding_window, scale, soft_cap, chunk_tokens):
    """Decode rows (blocks of one query), the work balanced across rows: the (row, chunk) pairs
    that hold live keys are numbered row by row, and each loop iteration takes the next
    ``PAIRS_PER_ROW * n`` of them, whichever rows they belong to. A row's chunks taken in one
    iteration are merged into its online-softmax state together (a max and two sums over the
    iteration's pairs), so the trip count is ceil(live chunks of all rows / (PAIRS_PER_ROW *
    n)): one long row among short ones no longer makes every row walk its length."""
    k_pages, v_pages, k_scales, v_scales = pool
    n, _, h, d = q.shape
    kvh = k_pages.shape[2]
    g = h // kvh
    scale = d**-0.5 if scale is None else scale
    tables, cp, chunks_static, chunk_len = _chunks(block_tables, k_pages.shape[1], chunk_tokens)

    last = q_positions[:, 0]  # [N] the row's position (-1: padding, no keys)
    end = jnp.clip((last + chunk_len) // chunk_len, 0, chunks_static)  # chunks up to the row's key
    first = jnp.zeros_like(end)
    if sliding_window is not None:  # chunks wholly before the row's window hold no key
        first = jnp.clip((last - sliding_window + 1) // chunk_len, 0, chunks_static)
    count = jnp.maximum(end - first, 0)  # [N] live chunks per row
    ends = jnp.cumsum(count)  # pair numbers: row r owns [ends[r] - count[r], ends[r])
    total = ends[-1]
    rows = jnp.arange(n, dtype=jnp.int32)
    b = PAIRS_PER_ROW * n  # pairs per loop iteration
    qg = q[:, 0].reshape(n, kvh, g, d).astype(jnp.float32) * scale  # [N, KVH, G, D]

    def body(carry):
        t, m, l_sum, acc = carry
        w = t * b + jnp.arange(b, dtype=jnp.int32)  # [B] the pairs this iteration takes
        valid = w < total
        r = jnp.clip(jnp.searchsorted(ends, w, side="right"), 0, n - 1).astype(jnp.int32)
        j = first[r] + w - (ends[r] - count[r])  # the pair's chunk within its row
        cols = jnp.clip(j, 0, chunks_static - 1)[:, None] * cp + jnp.arange(cp, dtype=jnp.int32)
        pages = tables[r[:, None], cols]  # [B, CP]
        k = gather_kv(k_pages, k_scales, pages, q.dtype).astype(jnp.float32)  # [B, CL, KVH, D]
        v = gather_kv(v_pages, v_scales, pages, q.dtype)
        kpos = j[:, None] * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [B, CL]
        live = valid[:, None] & key_mask(q_positions[r], kpos, sliding_window)[:, 0]  # [B, CL]
        # Masked scores are replaced by ``where``; V is zeroed there (0 x NaN garbage = NaN).
        v = jnp.where(live[:, :, None, None], v, 0).astype(jnp.float32)
        s = jnp.einsum("bkgd,bckd->bkgc", qg[r], k)  # [B, KVH, G, CL]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(live[:, None, None, :], s, _NEG)
        m_pair = jnp.max(s, axis=-1)  # [B, KVH, G]
        p = jnp.where(live[:, None, None, :], jnp.exp(s - m_pair[..., None]), 0.0)
        owner = (r[:, None] == rows[None, :]) & valid[:, None]  # [B, N]
        m_new = jnp.maximum(m, jnp.max(jnp.where(owner[..., None, None], m_pair[:, None], _NEG), 0))
        weight = jnp.exp(m_pair - m_new[r]) * valid[:, None, None]  # [B, KVH, G]
        alpha = jnp.exp(m - m_new)
        own = owner.astype(jnp.float32)
        l_sum = alpha * l_sum + jnp.einsum("bn,bkg->nkg", own, weight * jnp.sum(p, axis=-1))
        o = jnp.einsum("bkgc,bckd->bkgd", p, v) * weight[..., None]
        acc = alpha[..., None] * acc + jnp.einsum("bn,bkgd->nkgd", own, o)
        return t + 1, m_new, l_sum, acc

    init = (
        jnp.int32(0),
        jnp.full((n, kvh, g), _NEG, jnp.float32),
        jnp.zeros((n, kvh, g), jnp.float32),
        jnp.zeros((n, kvh, g, d), jnp.float32),
    )
    trips = (total + b - 1) // b
    _, _, l_sum, acc = jax.lax.while_loop(lambda c: c[0] < trips, body, init)
    o = acc / jnp.maximum(l_sum, 1e-30)[..., None]  # [N, KVH, G, D]
    return o.reshape(n, 1, h, d).astype(q.dtype)
