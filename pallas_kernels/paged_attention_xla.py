"""Paged attention in plain XLA that stops at the longest live context (the CPU / fallback path).

Same contract as :func:`paged_attention_reference` (see that module for the layout). Instead of
gathering every block's whole page list, it walks the page tables in chunks of about
``chunk_tokens`` keys with an online (flash-style) softmax inside a ``lax.while_loop`` whose
trip count is *traced*: ceil(longest live context / chunk). A step whose sequences are short only
gathers their few pages, and the context length never enters a shape, so it never recompiles.

Many single-row blocks (decode rows) are processed in groups of ``DECODE_ROW_GROUP``, one after
another, each group walking only to *its* longest context: the engine lists decode rows longest
first, so one long sequence no longer makes every row walk its length. Measured (CPU, 32 decode
rows, 9/3 heads, head dim 64): mixed lengths 1.4 -> 0.9 ms, one or two long rows among short
ones 3.7 -> 2.0 ms, but all of equal length 1.9 -> 2.3 ms — so groups are used only when they
save a third of the chunk iterations (a traced ``lax.cond``; both branches are compiled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.paged_attention_reference import _NEG, gather_kv, key_mask


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
    n, bq = q.shape[:2]
    g = DECODE_ROW_GROUP
    pool = (k_pages, v_pages, k_scales, v_scales)
    attend = lambda q, tables, pos: _attend(
        q, pool, tables, pos, sliding_window, scale, soft_cap, chunk_tokens
    )
    if not (bq == 1 and n > g and n % g == 0):
        return attend(q, block_tables, q_positions)

    def grouped(q, tables, pos):
        parts = tuple(x.reshape(n // g, g, *x.shape[1:]) for x in (q, tables, pos))
        return jax.lax.map(lambda a: attend(*a), parts).reshape(q.shape)

    # Groups pay off when their lengths differ: walk them only if that saves a third of the
    # chunk iterations (equal lengths: one loop over all rows is faster).
    group_len = jnp.max(q_positions.reshape(n // g, g), axis=1) + 1  # [N/G]
    group_chunks = (group_len + chunk_tokens - 1) // chunk_tokens
    skewed = 3 * jnp.sum(group_chunks) < 2 * (n // g) * jnp.max(group_chunks)
    return jax.lax.cond(skewed, grouped, attend, q, block_tables, q_positions)


DECODE_ROW_GROUP = 8  # single-row blocks per group (each group: its own trip count)


def _attend(q, pool, block_tables, q_positions, sliding_window, scale, soft_cap, chunk_tokens):
    k_pages, v_pages, k_scales, v_scales = pool
    n, bq, h, d = q.shape
    _, page_size, kvh, _ = k_pages.shape
    g = h // kvh
    scale = d**-0.5 if scale is None else scale
    mp = block_tables.shape[1]
    cp = max(1, min(chunk_tokens // page_size, mp))  # pages per loop iteration
    num_chunks_static = -(-mp // cp)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks_static * cp - mp)))  # [N, chunks*CP]
    chunk_len = cp * page_size

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
