"""Swap preemption: move one slot's KV pages and per-slot state to host RAM and back.

``swap_out`` gathers a slot's pages (padded to ``max_pages`` entries; padding reads are junk that
``swap_in`` drops) of every pool buffer — an 8-bit pool's scales with its data, and a draft
model's pool (speculative decoding) with the target's — and its rows of every per-slot array,
and retires the slot. ``swap_in`` writes them into freshly allocated pages of any free slot and
reactivates it: the sequence continues as if nothing happened — same positions, RNG counter
and penalty statistics, no recomputation.
A handover (``handover.py``) uses the same two functions with fewer page entries (a page bucket,
``buckets.handover_page_buckets``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int32

from jbatch.engine.sampler import SlotSampling
from jbatch.engine.state import EngineState
from jbatch.models.kv_cache import KVCache

_ROW_FIELDS = ("tokens", "seq_lens", "prefill_lens", "prompt_lens", "num_generated", "max_tokens")


@struct.dataclass
class SwappedSlot:
    kv: KVCache  # the slot's max_pages pages of every layer's buffers (scales included)
    rows: dict[str, Int32[Array, ""]]  # tokens, seq_lens, prefill_lens, ... of the slot
    sampling: SlotSampling  # scalar fields: the slot's sampling row
    prompt_mask: Bool[Array, " vocab"]
    output_counts: Int32[Array, " vocab"]
    draft_kv: KVCache | None = None  # the same pages of the draft model's pool, if any


def swap_out(
    state: EngineState, slot: Int32[Array, ""], pages: Int32[Array, " max_pages"]
) -> tuple[EngineState, SwappedSlot]:
    """Copy ``slot``'s pages and rows out and retire the slot."""
    idx = jnp.clip(pages, 0, state.cache.num_pages - 1)
    saved = SwappedSlot(
        kv=jax.tree.map(lambda buf: buf[idx], state.cache),
        rows={f: getattr(state, f)[slot] for f in _ROW_FIELDS},
        sampling=jax.tree.map(lambda a: a[slot], state.sampling),
        prompt_mask=state.prompt_mask[slot],
        output_counts=state.output_counts[slot],
        draft_kv=jax.tree.map(lambda buf: buf[idx], state.draft_cache),
    )
    return state.replace(active=state.active.at[slot].set(False)), saved


def swap_in(
    state: EngineState,
    slot: Int32[Array, ""],
    pages: Int32[Array, " max_pages"],
    saved: SwappedSlot,
    write_pages: Int32[Array, " max_pages"] | None = None,
) -> EngineState:
    """Write a swapped-out sequence into ``pages`` (entries == num_pages are padding) of a free
    ``slot`` and reactivate it. ``write_pages`` (default ``pages``): where each saved page is
    written — ``num_pages`` for a page the engine's prefix cache already holds, which the slot's
    page table then shares instead."""
    write = pages if write_pages is None else write_pages
    put = lambda buf, data: buf.at[write].set(data.astype(buf.dtype), mode="drop")
    cache = jax.tree.map(put, state.cache, saved.kv)
    draft_cache = jax.tree.map(put, state.draft_cache, saved.draft_kv)
    pad = state.page_tables.shape[1] - pages.shape[0]  # a handover's copy: fewer pages
    row = jnp.concatenate([pages, jnp.full(pad, state.cache.num_pages, pages.dtype)])
    rows = {f: getattr(state, f).at[slot].set(saved.rows[f]) for f in _ROW_FIELDS}
    return state.replace(
        cache=cache,
        draft_cache=draft_cache,
        page_tables=state.page_tables.at[slot].set(row),
        active=state.active.at[slot].set(True),
        sampling=jax.tree.map(lambda a, r: a.at[slot].set(r), state.sampling, saved.sampling),
        prompt_mask=state.prompt_mask.at[slot].set(saved.prompt_mask),
        output_counts=state.output_counts.at[slot].set(saved.output_counts),
        **rows,
    )
