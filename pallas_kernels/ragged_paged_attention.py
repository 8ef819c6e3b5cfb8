"""Ragged paged attention as one Pallas kernel: decode tokens and prompt chunks in a single call.

Layout (see :mod:`pallas_kernels.paged_attention_reference` for the KV pool): ``q [T, H, D]`` holds
the query rows of S sequences back to back; sequence ``i`` owns rows
``query_starts[i]:query_starts[i+1]``, which are its *last* ``query_len`` tokens (absolute
positions ``seq_lens[i] - query_len .. seq_lens[i] - 1``; their K/V is already in the pool). One
row is a decode step, many a prefill chunk; attention is causal, GQA, optionally windowed and
soft-capped.

Work decomposition (all computed in JAX before the kernel, so the kernel sees only fixed shapes):

* **Tiles.** Each sequence's rows are cut into tiles of ``block_q`` rows; a tile never spans two
  sequences. The number of tiles is bounded statically by ``min(T, T // block_q + min(S, T))``;
  tiles past the real count have every row at position -1 and do no work.
* **GQA group = MMA rows.** A tile's q block is ``block_q rows x G heads`` sharing one KV head,
  flattened to ``M = next_pow2(max(16, block_q * G))`` MMA rows — even a decode tile
  (``block_q = 1``) fills ``M >= 16`` with its G heads, and each K/V page is loaded once per group.
* **Grid** ``(tiles, KV heads, KV splits)``: split ``k`` walks its share of the tile's page table in
  blocks of ``pages_per_block`` pages with an online softmax (flash-decoding); the splits' partial
  results (normalised output, running max, denominator) are merged in JAX afterwards.
* **Masking.** Every MMA row carries its absolute position (-1 = nothing to compute). Keys at
  ``c <= p`` (and ``c > p - window``) are visible; keys at or past the tile's last position + 1 are
  zeroed before both products (pages there may hold NaN), page ids are clamped into the pool, and
  the loop bounds skip blocks past the tile's end or before its window.
* **8-bit pools** (``k_scales``/``v_scales``, :mod:`pallas_kernels.kv_quant`): the kernel loads
  each block's int8/float8 pages and their ``[pages, S]`` scale rows (the same page ids, the
  same KV head) and dequantizes them to the query dtype in registers, before the masking above:
  HBM traffic is the 8-bit pages plus 2 bytes per key, and nothing widens the pool.

Backend: the kernel is written with portable Pallas primitives (``BlockSpec`` indexing, gather by
page id, ``lax.dot_general``) and lowered by the Triton backend; ``_compiler_params`` is the one
place a Mosaic GPU variant would plug in. ``interpret=True`` runs it anywhere (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.kv_quant import check_scales, dequantize
from pallas_kernels.paged_attention_reference import _NEG, paged_attention_reference

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


# ----------------------------------------------------------------------------------------- kernel


def _kernel(
    pos_ref,  # [M] absolute position of each MMA row (-1: nothing to compute)
    tables_ref,  # [PPS] this split's page ids (clamped into the pool)
    q_ref,  # [M, D] block_q rows x G heads of one KV head
    k_ref,  # [P, S, D] the whole pool of this KV head (8-bit when quantized)
    v_ref,  # [P, S, D]
    *refs,  # quantized: ks_ref, vs_ref ([P, S] scales of this KV head); then the outputs:
    # o_ref [M, D] float32, normalised by this split's denominator; m_ref [M] running max of
    # this split; l_ref [M] softmax denominator of this split
    quantized: bool,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
):
    ks_ref, vs_ref, o_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
    split = pl.program_id(2)
    m_rows, d = q_ref.shape
    page_size = k_ref.shape[1]
    pages_per_split = tables_ref.shape[0]
    block_k = pages_per_block * page_size
    split_start = split * (pages_per_split * page_size)  # first key position of this split

    pos = pos_ref[...]  # [M]
    kv_end = jnp.max(pos) + 1  # keys [0, kv_end) can be visible to this tile
    lo = split_start
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max))
        lo = jnp.maximum(lo, lowest - sliding_window + 1)
    hi = jnp.minimum(split_start + pages_per_split * page_size, kv_end)
    first_blk = jax.lax.div(lo - split_start, block_k)
    end_blk = jax.lax.div(jnp.maximum(hi - split_start, 0) + block_k - 1, block_k)

    q = q_ref[...]  # [M, D]

    def body(b, carry):
        acc, m_prev, l_prev = carry  # [M, D], [M], [M]
        ids = tables_ref[pl.ds(b * pages_per_block, pages_per_block)]  # [PPB]
        k = k_ref[ids].reshape(block_k, d)  # [BK, D]
        v = v_ref[ids].reshape(block_k, d)  # [BK, D]
        if quantized:  # dequantize before masking: a NaN scale is masked like NaN data
            k = dequantize(k, ks_ref[ids].reshape(block_k), q.dtype)
            v = dequantize(v, vs_ref[ids].reshape(block_k), q.dtype)
        kpos = split_start + b * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
        live = (kpos < kv_end)[:, None]  # [BK, 1]; never-written keys may be NaN
        k = jnp.where(live, k, jnp.zeros_like(k))
        v = jnp.where(live, v, jnp.zeros_like(v))
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [M, BK]
        s = s * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = kpos[None, :] <= pos[:, None]  # [M, BK]; pos -1 masks the whole row
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask, s, _NEG)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [M]
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)  # [M, BK]
        alpha = jnp.exp(m_prev - m_next)  # [M]
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )  # [M, D]
        return alpha[:, None] * acc + pv, m_next, l_next

    init = (
        jnp.zeros((m_rows, d), jnp.float32),
        jnp.full((m_rows,), _NEG, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
    )
    acc, m_i, l_i = jax.lax.fori_loop(first_blk, end_blk, body, init)
    o_ref[...] = acc / jnp.maximum(l_i, 1e-30)[:, None]
    m_ref[...] = m_i
    l_ref[...] = l_i


# ---------------------------------------------------------------------------------------- wrapper


def _compiler_params(backend: str):
    """The one place that knows the GPU backend (a Mosaic GPU variant would branch here)."""
    if backend != "triton":
        raise ValueError(f"backend must be 'triton', got {backend!r}")
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _ragged_pallas_call(
    q_tiles: Float[Array, "n kvh m d"],
    k_pages: Shaped[Array, "p s kvh d"],
    v_pages: Shaped[Array, "p s kvh d"],
    tile_tables: Int[Array, "n k pps"],
    tile_pos: Int[Array, "n m"],
    scales: tuple[Float[Array, "p s kvh"], Float[Array, "p s kvh"]] | None,
    *,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_block: int,
    backend: str,
    interpret: bool,
):
    n, kvh, m, d = q_tiles.shape
    num_pages, page_size, _, _ = k_pages.shape
    splits, pps = tile_tables.shape[1:]
    kernel = functools.partial(
        _kernel,
        quantized=scales is not None,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_block=pages_per_block,
    )
    pool_spec = pl.BlockSpec((num_pages, page_size, None, d), lambda i, h, k: (0, 0, h, 0))
    scale_spec = pl.BlockSpec((num_pages, page_size, None), lambda i, h, k: (0, 0, h))
    row_spec = pl.BlockSpec((None, None, None, m), lambda i, h, k: (k, i, h, 0))
    scales = () if scales is None else tuple(scales)
    return pl.pallas_call(
        kernel,
        grid=(n, kvh, splits),
        in_specs=[
            pl.BlockSpec((None, m), lambda i, h, k: (i, 0)),  # tile_pos
            pl.BlockSpec((None, None, pps), lambda i, h, k: (i, k, 0)),  # tile_tables
            pl.BlockSpec((None, None, m, d), lambda i, h, k: (i, h, 0, 0)),  # q_tiles
            pool_spec,  # k_pages
            pool_spec,  # v_pages
            *[scale_spec] * len(scales),  # k_scales, v_scales (8-bit pools)
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, m, d), lambda i, h, k: (k, i, h, 0, 0)),
            row_spec,
            row_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, n, kvh, m, d), jnp.float32),  # o
            jax.ShapeDtypeStruct((splits, n, kvh, m), jnp.float32),  # m
            jax.ShapeDtypeStruct((splits, n, kvh, m), jnp.float32),  # l
        ],
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(backend),
        name=f"ragged_paged_attention_m{m}_bk{pages_per_block * page_size}"
        + ("_q8" if scales else ""),
    )(tile_pos, tile_tables, q_tiles, k_pages, v_pages, *scales)


# -------------------------------------------------------------------------- validated entry point


def kernel_supports(head_dim: int, page_size: int, dtype) -> bool:
    """Whether the kernel handles these sizes (``"auto"`` falls back to XLA when it does not)."""
    return (
        _pow2(head_dim)
        and head_dim >= 16
        and _pow2(page_size)
        and jnp.dtype(dtype) in [jnp.dtype(x) for x in SUPPORTED_DTYPES]
    )


def _validate(q, k_pages, v_pages, page_tables, seq_lens, query_starts, block_q, ppb, splits):
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(
            f"q must be [T, H, D] and k_pages [P, S, KVH, D]; got {q.shape}, {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    (_, h, d), (_, page_size, kvh, dk) = q.shape, k_pages.shape
    if h % kvh:
        raise ValueError(f"query heads H={h} not divisible by KV heads KVH={kvh}")
    if d != dk:
        raise ValueError(f"q head dim {d} != K/V head dim {dk}")
    if not _pow2(d) or d < 16:
        raise ValueError(f"head dim D={d} not supported: must be a power of two >= 16")
    if not _pow2(page_size):
        raise ValueError(f"page size S={page_size} not supported: must be a power of two")
    s = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    if s < 1 or page_tables.ndim != 2 or page_tables.shape[0] != s:
        raise ValueError(
            f"seq_lens {seq_lens.shape} must be [S] and page_tables "
            f"{page_tables.shape} [S, max_pages]"
        )
    if query_starts.shape != (s + 1,):
        raise ValueError(f"query_starts {query_starts.shape} must be [S + 1] = [{s + 1}]")
    ints = {"page_tables": page_tables, "seq_lens": seq_lens, "query_starts": query_starts}
    bad = {n: str(a.dtype) for n, a in ints.items() if not jnp.issubdtype(a.dtype, jnp.integer)}
    if bad:
        raise ValueError(f"index arrays must be integer, got {bad}")
    if not _pow2(block_q):
        raise ValueError(f"block_q={block_q} must be a power of two")
    if not _pow2(ppb) or ppb * page_size < 16:
        raise ValueError(
            f"pages_per_block={ppb} x page size {page_size} must be a power of two >= 16 keys"
        )
    if splits < 1:
        raise ValueError(f"num_kv_splits={splits} must be >= 1")


def _tile_metadata(query_starts, seq_lens, num_tiles: int, block_q: int):
    """Per tile: sequence id, first token row, per-row positions ([N, block_q], -1 = none)."""
    qs = query_starts.astype(jnp.int32)
    qlen = qs[1:] - qs[:-1]  # [S]
    tile_end = jnp.cumsum((qlen + block_q - 1) // block_q)  # [S]
    tile_begin = tile_end - (qlen + block_q - 1) // block_q
    n = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, n, side="right"), qlen.shape[0] - 1)  # [N]
    first = qs[seq] + (n - tile_begin[seq]) * block_q  # [N]
    rows = jnp.where(n < tile_end[-1], jnp.clip(qs[seq + 1] - first, 0, block_q), 0)
    r = jnp.arange(block_q, dtype=jnp.int32)
    tok = first[:, None] + r  # [N, Bq]
    pos0 = (seq_lens.astype(jnp.int32) - qlen - qs[:-1])[seq]  # position = tok + pos0
    pos = jnp.where(r < rows[:, None], tok + pos0[:, None], -1)
    return seq, tok, jnp.maximum(pos, -1), tile_begin


def _default_kv_splits(programs: int, max_pages: int, ppb: int) -> int:
    """Flash-decoding split: enough programs to fill ~2 waves of an H100/H200 (unmeasured)."""
    if programs >= 264:
        return 1
    return max(1, min(_pow2_floor(264 // programs), max_pages // ppb, 16))


_STATIC = "sliding_window soft_cap scale block_q max_query_len pages_per_block num_kv_splits"


@functools.partial(jax.jit, static_argnames=(*_STATIC.split(), "backend", "interpret"))
def ragged_paged_attention(
    q: Float[Array, "t h d"],
    k_pages: Shaped[Array, "p s kvh d"],
    v_pages: Shaped[Array, "p s kvh d"],
    page_tables: Int[Array, "seqs mp"],
    seq_lens: Int[Array, " seqs"],
    query_starts: Int[Array, " seqs_plus_1"],
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    max_query_len: int | None = None,
    pages_per_block: int | None = None,
    num_kv_splits: int | None = None,
    backend: str = "triton",
    interpret: bool = False,
    k_scales: Float[Array, "p s kvh"] | None = None,
    v_scales: Float[Array, "p s kvh"] | None = None,
) -> Float[Array, "t h d"]:
    """Causal GQA attention of ragged query rows over a paged pool (rows outside every sequence
    return zeros). ``max_query_len`` (static) is an upper bound on any sequence's query rows:
    ``max_query_len=1`` selects the decode tiling (one row x G heads per tile). ``block_q``,
    ``pages_per_block`` and ``num_kv_splits`` override the tiling heuristics. An 8-bit pool
    passes its ``k_scales``/``v_scales``."""
    t, h, d = q.shape
    num_pages, page_size, kvh, _ = k_pages.shape
    g = h // max(kvh, 1)
    if block_q is None:
        block_q = _pow2_floor(max(1, 64 // max(g, 1)))
        if max_query_len is not None:
            block_q = min(block_q, _next_pow2(max_query_len))
    mp = page_tables.shape[-1] if page_tables.ndim == 2 else 1
    if pages_per_block is None:
        pages_per_block = max(-(-16 // page_size), min(128 // page_size, _pow2_floor(mp)))
    num_tiles = min(t, t // block_q + min(seq_lens.shape[0], t))
    splits = num_kv_splits or _default_kv_splits(max(num_tiles, 1) * kvh, mp, pages_per_block)
    _validate(
        q, k_pages, v_pages, page_tables, seq_lens, query_starts, block_q, pages_per_block, splits
    )
    check_scales(k_pages, v_pages, k_scales, v_scales)
    if q.dtype not in SUPPORTED_DTYPES or (k_scales is None and k_pages.dtype != q.dtype):
        raise ValueError(
            f"q dtype must be f32/bf16/f16 and match a float pool's; got q {q.dtype}, "
            f"k/v {k_pages.dtype}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap={soft_cap} must be > 0")
    if t == 0:
        return q
    scale = d**-0.5 if scale is None else scale
    m = max(16, _next_pow2(block_q * g))

    seq, tok, pos, tile_begin = _tile_metadata(query_starts, seq_lens, num_tiles, block_q)
    tile_pos = jnp.pad(
        jnp.repeat(pos, g, axis=1), ((0, 0), (0, m - block_q * g)), constant_values=-1
    )  # [N, M]
    q_tiles = q.reshape(t, kvh, g, d)[jnp.clip(tok, 0, t - 1)]  # [N, Bq, KVH, G, D]
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_tiles, kvh, block_q * g, d)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, m - block_q * g), (0, 0)))  # [N, KVH, M, D]
    pps = pl.cdiv(pl.cdiv(mp, splits), pages_per_block) * pages_per_block  # pages per split
    tables = jnp.clip(page_tables.astype(jnp.int32), 0, num_pages - 1)[seq]  # [N, MP]
    tables = jnp.pad(tables, ((0, 0), (0, splits * pps - mp))).reshape(num_tiles, splits, pps)

    o, m_s, l_s = _ragged_pallas_call(
        q_tiles,
        k_pages,
        v_pages,
        tables,
        tile_pos,
        None if k_scales is None else (k_scales, v_scales),
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_block=pages_per_block,
        backend=backend,
        interpret=interpret,
    )  # [K, N, KVH, M, D], [K, N, KVH, M] x2
    if splits > 1:  # flash-decoding combine: weight each split by exp(m_k - m) * l_k
        w = jnp.exp(m_s - jnp.max(m_s, axis=0)) * l_s  # [K, N, KVH, M]
        o = jnp.sum(w[..., None] * o, axis=0) / jnp.maximum(jnp.sum(w, axis=0), 1e-30)[..., None]
    else:
        o = o[0]  # [N, KVH, M, D]
    o = o[:, :, : block_q * g].reshape(num_tiles, kvh, block_q, g, d)

    qs = query_starts.astype(jnp.int32)
    rows = jnp.arange(t, dtype=jnp.int32)
    row_seq = jnp.minimum(jnp.searchsorted(qs[1:], rows, side="right"), qs.shape[0] - 2)  # [T]
    local = rows - qs[row_seq]
    row_tile = jnp.clip(tile_begin[row_seq] + local // block_q, 0, num_tiles - 1)
    out = o[row_tile, :, local % block_q]  # [T, KVH, G, D]
    inside = (rows >= qs[0]) & (rows < qs[-1])
    return jnp.where(inside[:, None, None, None], out, 0).reshape(t, h, d).astype(q.dtype)


# ------------------------------------------------------------------------------ pure-JAX reference


def ragged_paged_attention_reference(
    q: Float[Array, "t h d"],
    k_pages: Shaped[Array, "p s kvh d"],
    v_pages: Shaped[Array, "p s kvh d"],
    page_tables: Int[Array, "seqs mp"],
    seq_lens: Int[Array, " seqs"],
    query_starts: Int[Array, " seqs_plus_1"],
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    k_scales: Float[Array, "p s kvh"] | None = None,
    v_scales: Float[Array, "p s kvh"] | None = None,
) -> Float[Array, "t h d"]:
    """Same contract, via the block oracle with one row per block (gathers whole page lists)."""
    t = q.shape[0]
    qs = query_starts.astype(jnp.int32)
    rows = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(qs[1:], rows, side="right"), qs.shape[0] - 2)  # [T]
    qlen = qs[1:] - qs[:-1]
    pos = seq_lens.astype(jnp.int32)[seq] - qlen[seq] + rows - qs[seq]
    pos = jnp.where((rows >= qs[0]) & (rows < qs[-1]) & (pos >= 0), pos, -1)  # [T]
    out = paged_attention_reference(
        q[:, None],
        k_pages,
        v_pages,
        page_tables[seq],
        pos[:, None],
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        scale=scale,
        k_scales=k_scales,
        v_scales=v_scales,
    )  # [T, 1, H, D]
    return out[:, 0]
