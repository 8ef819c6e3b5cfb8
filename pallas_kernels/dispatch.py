"""The one attention entry the model calls; picks an implementation by name.

``impl`` is static (a Python string), so the choice is made at trace time and costs nothing per
step. ``"auto"`` resolves to the fastest implementation available on the default backend.
"""

from __future__ import annotations

import functools

import jax
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention_reference import paged_attention_reference
from pallas_kernels.paged_attention_xla import paged_attention_xla

IMPLEMENTATIONS = ("auto", "reference", "xla")


def resolve_impl(impl: str) -> str:
    """Map ``impl`` to a concrete implementation name, or raise naming the bad value."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "auto":
        return "xla"
    return impl


@functools.partial(jax.named_call, name="paged_attention")
def paged_attention(
    q: Float[Array, "n bq h d"],
    k_pages: Float[Array, "p s kvh d"],
    v_pages: Float[Array, "p s kvh d"],
    block_tables: Int[Array, "n mp"],
    q_positions: Int[Array, "n bq"],
    *,
    sliding_window: int | None = None,
    impl: str = "auto",
) -> Float[Array, "n bq h d"]:
    """Attention of query blocks over a paged KV pool (layout: ``paged_attention_reference``)."""
    if q.shape[0] == 0:
        return q
    fn = {"reference": paged_attention_reference, "xla": paged_attention_xla}[resolve_impl(impl)]
    return fn(q, k_pages, v_pages, block_tables, q_positions, sliding_window=sliding_window)
