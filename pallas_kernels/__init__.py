"""Paged attention kernels and their pure-JAX references."""

from pallas_kernels.cpu_attention import cpu_paged_attention
from pallas_kernels.dispatch import (
    IMPLEMENTATIONS,
    PALLAS_IMPLS,
    paged_attention,
    paged_attention_rows,
    resolve_impl,
)
from pallas_kernels.paged_attention_reference import paged_attention_reference
from pallas_kernels.paged_attention_xla import paged_attention_xla
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "IMPLEMENTATIONS",
    "PALLAS_IMPLS",
    "cpu_paged_attention",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_rows",
    "paged_attention_xla",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_impl",
]
