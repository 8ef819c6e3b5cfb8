"""The one attention entry the model calls; picks an implementation by name.

``impl`` is static (a Python string), so the choice is made at trace time and costs nothing per
step. ``"auto"`` resolves to the fastest implementation available on the default backend: the
Pallas ragged kernel on GPU, the chunked XLA path elsewhere. ``"pallas_interpret"`` runs the same
Pallas kernel in interpret mode (any backend, slow): it is how CPU tests exercise the GPU kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.paged_attention_reference import paged_attention_reference
from pallas_kernels.paged_attention_xla import paged_attention_xla
from pallas_kernels.ragged_paged_attention import kernel_supports, ragged_paged_attention

IMPLEMENTATIONS = ("auto", "reference", "xla", "pallas", "pallas_interpret")
PALLAS_IMPLS = ("pallas", "pallas_interpret")


def resolve_impl(impl: str, q=None, k_pages=None) -> str:
    """Map ``impl`` to a concrete implementation name, or raise naming the bad value.

    Given the arrays, ``"auto"`` also falls back to XLA for sizes the kernel does not support."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        ok = k_pages is None or kernel_supports(q.shape[-1], k_pages.shape[1], q.dtype)
        return "pallas" if jax.default_backend() == "gpu" and ok else "xla"
    return impl


def paged_attention_rows(
    q: Float[Array, "t h d"],
    k_pages: Shaped[Array, "p s kvh d"],
    v_pages: Shaped[Array, "p s kvh d"],
    row_entry: Int[Array, " t"],
    entry_tables: Int[Array, "e mp"],
    positions: Int[Array, " t"],
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    max_query_len: int | None = None,
    interpret: bool = False,
    k_scales: Float[Array, "p s kvh"] | None = None,
    v_scales: Float[Array, "p s kvh"] | None = None,
) -> Float[Array, "t h d"]:
    """Flat rows grouped into entries (contiguous runs of rows, entry ``row_entry[t]``, each one
    sequence reading ``entry_tables[e]``) through ONE ragged Pallas call.

    An entry's valid rows (position >= 0) must be its last tokens in order, padding rows may sit
    anywhere: valid rows are packed to the front (stable), the kernel runs on the packed batch and
    padding rows come back as zeros."""
    t = q.shape[0]
    e = entry_tables.shape[0]
    valid = positions >= 0
    qlen = jax.ops.segment_sum(valid.astype(jnp.int32), row_entry, e)  # [E]
    seq_lens = jnp.maximum(jax.ops.segment_max(positions, row_entry, e) + 1, 0)  # [E]
    query_starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(qlen)]).astype(jnp.int32)
    dest = jnp.cumsum(valid) - 1  # packed row of each valid row
    q_packed = jnp.zeros_like(q).at[jnp.where(valid, dest, t)].set(q, mode="drop")
    out = ragged_paged_attention(
        q_packed,
        k_pages,
        v_pages,
        entry_tables,
        seq_lens,
        query_starts,
        sliding_window=sliding_window,
        scale=scale,
        soft_cap=soft_cap,
        max_query_len=max_query_len,
        interpret=interpret,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    return jnp.where(valid[:, None, None], out[jnp.clip(dest, 0, t - 1)], 0).astype(q.dtype)


@functools.partial(jax.named_call, name="paged_attention")
def paged_attention(
    q: Float[Array, "n bq h d"],
    k_pages: Shaped[Array, "p s kvh d"],
    v_pages: Shaped[Array, "p s kvh d"],
    block_tables: Int[Array, "n mp"],
    q_positions: Int[Array, "n bq"],
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    impl: str = "auto",
    k_scales: Float[Array, "p s kvh"] | None = None,
    v_scales: Float[Array, "p s kvh"] | None = None,
) -> Float[Array, "n bq h d"]:
    """Attention of query blocks over a paged KV pool (layout: ``paged_attention_reference``).
    ``scale`` is the softmax scale (default ``head_dim ** -0.5``); ``soft_cap`` squashes scores
    to ``cap * tanh(score / cap)`` (Gemma 2). An 8-bit pool passes its ``k_scales``/``v_scales``.

    With a Pallas impl a block's valid rows must be its last tokens in order (as the engine
    builds them): see :func:`paged_attention_rows`."""
    if q.shape[0] == 0:
        return q
    impl = resolve_impl(impl, q, k_pages)
    if impl in PALLAS_IMPLS:
        n, bq, h, d = q.shape
        out = paged_attention_rows(
            q.reshape(n * bq, h, d),
            k_pages,
            v_pages,
            jnp.repeat(jnp.arange(n, dtype=jnp.int32), bq),
            block_tables,
            q_positions.reshape(n * bq),
            sliding_window=sliding_window,
            scale=scale,
            soft_cap=soft_cap,
            max_query_len=bq,
            interpret=impl == "pallas_interpret",
            k_scales=k_scales,
            v_scales=v_scales,
        )
        return out.reshape(n, bq, h, d)
    fn = {"reference": paged_attention_reference, "xla": paged_attention_xla}[impl]
    return fn(
        q,
        k_pages,
        v_pages,
        block_tables,
        q_positions,
        sliding_window=sliding_window,
        scale=scale,
        soft_cap=soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
    )
