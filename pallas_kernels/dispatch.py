"""The one attention entry the model calls; picks an implementation by name.

``impl`` is static (a Python string), so the choice is made at trace time and costs nothing per
step. ``"auto"`` resolves to the fastest implementation available on the default backend: the
Pallas ragged kernel on GPU, JAX's TPU ragged kernel on TPU (float pools; ``"tpu"``, through
:mod:`pallas_kernels.tpu_attention`, which the model calls itself), the native kernel of
:mod:`pallas_kernels.cpu_attention` on CPU (``"cpu"``: decode rows and speculative groups; prompt
blocks too when their rows see few keys, a choice made at run time, else the chunked XLA path),
the chunked XLA path where none of these applies.
``"pallas_interpret"`` runs the same
Pallas kernel in interpret mode (any backend, slow): it is how CPU tests exercise the GPU kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels import cpu_attention
from pallas_kernels.paged_attention_reference import paged_attention_reference
from pallas_kernels.paged_attention_xla import paged_attention_xla
from pallas_kernels.ragged_paged_attention import kernel_supports, ragged_paged_attention
from pallas_kernels.ragged_rows import pack_rows
from pallas_kernels.tpu_attention import kernel_supports as tpu_kernel_supports

IMPLEMENTATIONS = ("auto", "reference", "xla", "pallas", "pallas_interpret", "tpu", "cpu")
PALLAS_IMPLS = ("pallas", "pallas_interpret")


def resolve_impl(impl: str, q=None, k_pages=None) -> str:
    """Map ``impl`` to a concrete implementation name, or raise naming the bad value.

    Given the arrays, ``"auto"`` also falls back to XLA for sizes the kernel does not support
    (on TPU: 8-bit pools, whose per-token scales JAX's kernel cannot take; on CPU: dtypes the
    native kernel does not take, or no C++ compiler to build it)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    backend = jax.default_backend()
    cpu_ok = k_pages is None or cpu_attention.supports(q.dtype, k_pages.dtype)
    if impl == "auto" and backend == "cpu":
        return "cpu" if cpu_attention.available() and cpu_ok else "xla"
    if impl == "cpu":
        if not cpu_attention.available():
            raise ValueError(
                f"attn_impl='cpu' needs the native CPU kernel: {cpu_attention.unavailable_reason()}"
            )
        if not cpu_ok:
            raise ValueError(
                f"attn_impl='cpu' takes q in {cpu_attention.QUERY_DTYPES} and pools in "
                f"{cpu_attention.POOL_DTYPES}, got q {q.dtype}, pool {k_pages.dtype}"
            )
    if impl == "auto" and backend == "tpu":
        impl = "tpu" if k_pages is None or tpu_kernel_supports(k_pages.dtype) else "xla"
    if impl == "auto":
        ok = k_pages is None or kernel_supports(q.shape[-1], k_pages.shape[1], q.dtype)
        return "pallas" if backend == "gpu" and ok else "xla"
    if impl == "tpu" and k_pages is not None and not tpu_kernel_supports(k_pages.dtype):
        raise ValueError(f"attn_impl='tpu' needs a float32/bfloat16 pool, got {k_pages.dtype}")
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
    rows = pack_rows(row_entry, positions, entry_tables.shape[0])
    out = ragged_paged_attention(
        rows.pack(q),
        k_pages,
        v_pages,
        entry_tables,
        rows.seq_lens,
        rows.query_starts,
        sliding_window=sliding_window,
        scale=scale,
        soft_cap=soft_cap,
        max_query_len=max_query_len,
        interpret=interpret,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    return rows.unpack(out, q.dtype)


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
    if impl == "tpu":
        raise ValueError("impl='tpu' reads the kernel's pool layout: use tpu_paged_attention_rows")
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
    options = dict(sliding_window=sliding_window, scale=scale, soft_cap=soft_cap,
                   k_scales=k_scales, v_scales=v_scales)  # fmt: skip
    if impl == "cpu" and q.shape[1] > cpu_attention.MAX_BLOCK_Q:
        return _cpu_prompt_blocks(q, k_pages, v_pages, block_tables, q_positions, options)
    fn = {
        "reference": paged_attention_reference,
        "xla": paged_attention_xla,
        "cpu": cpu_attention.cpu_paged_attention,
    }[impl]
    return fn(q, k_pages, v_pages, block_tables, q_positions, **options)


def prompt_keys(q_positions: Int[Array, "n bq"], sliding_window: int | None) -> Int[Array, ""]:
    """The most keys any row of the call reads: its last position + 1, at most the window."""
    keys = jnp.max(q_positions) + 1
    return keys if sliding_window is None else jnp.minimum(keys, sliding_window)


def _cpu_prompt_blocks(q, k_pages, v_pages, block_tables, q_positions, options: dict):
    """Prompt blocks on CPU: the native kernel when no row sees more than
    ``cpu_attention.MAX_PROMPT_KEYS`` keys, else XLA's chunked batched dots; both are compiled
    into the program and the step's positions pick one (no recompile)."""
    short = prompt_keys(q_positions, options["sliding_window"]) <= cpu_attention.MAX_PROMPT_KEYS
    args = (q, k_pages, v_pages, block_tables, q_positions)
    return jax.lax.cond(
        short,
        lambda a: cpu_attention.cpu_paged_attention(*a, **options),
        lambda a: paged_attention_xla(*a, **options),
        args,
    )
