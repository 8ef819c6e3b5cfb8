"""The engine's flat rows through JAX's own TPU ragged paged attention kernel.

:func:`tpu_kernel_args` is the adapter: engine rows (entries, page tables, positions) and a pool
in the kernel's layout (:mod:`pallas_kernels.tpu_layout`) become that kernel's arguments —
queries packed and head-padded, ``kv_lens``, clamped ``page_indices``, ``cu_q_lens``,
``num_seqs`` and the static keywords. :func:`tpu_paged_attention_rows` runs them through the
kernel (``kernel=None``) or any function of the same signature (tests pass JAX's
``ref_ragged_paged_attention``), then unpads and unpacks.

The kernel does not run on CPU (not in TPU interpret mode either, on jax 0.10.2 / 0.12), so CPU
can check the adapter against JAX's reference and the Mosaic lowering
(:func:`pallas_kernels.cross_lowering.tpu_lowering_context`); only a TPU runs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.cross_lowering import tpu_lowering_context
from pallas_kernels.ragged_rows import PackedRows, pack_rows
from pallas_kernels.tpu_layout import TpuPoolLayout, pad_query_heads, unpad_query_heads

__all__ = ["tpu_kernel_args", "tpu_lowering_context", "tpu_paged_attention_rows"]

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
# Off TPU the kernel cannot look its block sizes up (it asks the chip): use its own untuned
# defaults (128 KV pages, 32 queries per block; clamped to the shapes) and a 32 MiB VMEM budget.
DEFAULT_KV_PAGES_PER_BLOCK = 128
DEFAULT_QUERIES_PER_BLOCK = 32
DEFAULT_VMEM_LIMIT_BYTES = 32 * 1024 * 1024


def kernel_supports(dtype) -> bool:
    """Whether the kernel takes a pool of ``dtype`` (8-bit pools: no, see docs)."""
    return jnp.dtype(dtype) in [jnp.dtype(x) for x in SUPPORTED_DTYPES]


def block_sizes(num_tokens: int, pages_per_seq: int) -> dict:
    """Explicit block sizes off TPU; on TPU ``None`` lets the kernel use its tuned table."""
    if jax.default_backend() == "tpu":
        return {}
    return dict(
        num_kv_pages_per_block=min(pages_per_seq, DEFAULT_KV_PAGES_PER_BLOCK),
        num_queries_per_block=min(num_tokens, DEFAULT_QUERIES_PER_BLOCK),
        vmem_limit_bytes=DEFAULT_VMEM_LIMIT_BYTES,
    )


def tpu_kernel_args(
    q: Float[Array, "t h d"],
    kv_pages: Shaped[Array, "p s ckvh dp"],
    row_entry: Int[Array, " t"],
    entry_tables: Int[Array, "e mp"],
    positions: Int[Array, " t"],
    layout: TpuPoolLayout,
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
) -> tuple[tuple, dict, PackedRows]:
    """(positional args, keywords, packing) of the kernel for a flat batch; every sequence is
    one entry (a decode row, or one prompt block), so ``num_seqs`` is the entry count."""
    _, h, d = q.shape
    num_pages, _, ckvh, dp = kv_pages.shape
    if (ckvh, dp) != (layout.combined_heads, layout.head_dim_padded):
        raise ValueError(
            f"kv_pages {kv_pages.shape} is not in the layout {layout} (expected "
            f"[P, S, {layout.combined_heads}, {layout.head_dim_padded}])"
        )
    if d != layout.head_dim or h % layout.num_kv_heads:
        raise ValueError(f"q {q.shape} does not fit the layout {layout}")
    if not kernel_supports(kv_pages.dtype) or kv_pages.dtype != q.dtype:
        raise ValueError(
            f"the TPU kernel needs q and pool of one dtype in {SUPPORTED_DTYPES}; got q "
            f"{q.dtype}, pool {kv_pages.dtype}"
        )
    e = entry_tables.shape[0]
    rows = pack_rows(row_entry, positions, e)
    page_indices = jnp.clip(entry_tables.astype(jnp.int32), 0, num_pages - 1)  # DMA in bounds
    args = (
        pad_query_heads(rows.pack(q), layout),
        kv_pages,
        rows.seq_lens,
        page_indices,
        rows.query_starts,
        jnp.array([e], jnp.int32),
    )
    kw = dict(
        sm_scale=float(d**-0.5 if scale is None else scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return args, kw, rows


def tpu_paged_attention_rows(
    q: Float[Array, "t h d"],
    kv_pages: Shaped[Array, "p s ckvh dp"],
    row_entry: Int[Array, " t"],
    entry_tables: Int[Array, "e mp"],
    positions: Int[Array, " t"],
    layout: TpuPoolLayout,
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    kernel=None,
) -> Float[Array, "t h d"]:
    """Flat engine rows (see :mod:`pallas_kernels.ragged_rows`) through ONE kernel call;
    ``kernel`` defaults to JAX's TPU kernel with :func:`block_sizes`."""
    args, kw, rows = tpu_kernel_args(
        q,
        kv_pages,
        row_entry,
        entry_tables,
        positions,
        layout,
        sliding_window=sliding_window,
        scale=scale,
        soft_cap=soft_cap,
    )
    if kernel is None:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention,
        )

        kernel = ragged_paged_attention
        kw.update(block_sizes(q.shape[0], entry_tables.shape[1]))
    out = kernel(*args, **kw)  # [T, Hp, Dp]
    return rows.unpack(unpad_query_heads(out, layout, q.shape[1]), q.dtype)
