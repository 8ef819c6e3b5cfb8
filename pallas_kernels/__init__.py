"""Paged attention kernels and their pure-JAX references."""

from pallas_kernels.dispatch import IMPLEMENTATIONS, paged_attention, resolve_impl
from pallas_kernels.paged_attention_reference import paged_attention_reference
from pallas_kernels.paged_attention_xla import paged_attention_xla

__all__ = [
    "IMPLEMENTATIONS",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_xla",
    "resolve_impl",
]
