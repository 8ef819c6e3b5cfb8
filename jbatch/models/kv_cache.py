"""The paged KV pool: one K and one V array per model, stacked over layers.

Layout ``[L, KVH, P, S, D]`` (layers, KV heads, pages, page size, head dim):

* KV heads come right after the layer axis, so tensor parallelism shards the pool on that axis
  and every chip holds the pages of its own heads, with page ids identical on all chips (the page
  tables stay replicated).
* Within one (layer, head) a page is a contiguous ``S x D`` tile — exactly what a GPU kernel loads
  for one block of keys — and the per-layer slice ``[KVH, P, S, D]`` is the layout of JAX's own
  Pallas ``paged_attention``.
* Page ids are shared by all layers: a sequence's page table says where its tokens live in every
  layer at once.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from jbatch.models.config import ModelConfig


@struct.dataclass
class KVCache:
    k: Float[Array, "layers kv_heads pages page_size head_dim"]
    v: Float[Array, "layers kv_heads pages page_size head_dim"]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> KVCache:
        shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write_locations(
    page_tables: Int[Array, "slots max_pages"],
    slots: Int[Array, " t"],
    positions: Int[Array, " t"],
    page_size: int,
    num_pages: int,
) -> tuple[Int[Array, " t"], Int[Array, " t"]]:
    """(page, offset) of each token's K/V; padding tokens (position < 0) get page ``num_pages``,
    out of bounds, so their scatter is dropped."""
    max_pages = page_tables.shape[1]
    page_idx = jnp.clip(positions // page_size, 0, max_pages - 1)
    slot_idx = jnp.clip(slots, 0, page_tables.shape[0] - 1)
    page = page_tables[slot_idx, page_idx]
    page = jnp.where((positions >= 0) & (page >= 0), page, num_pages)
    return page, positions % page_size


def write_layer(
    cache: KVCache,
    layer: int,
    k_new: Float[Array, "t kvh d"],
    v_new: Float[Array, "t kvh d"],
    pages: Int[Array, " t"],
    offsets: Int[Array, " t"],
) -> KVCache:
    """Scatter one layer's new K/V rows into the pool (in place when the cache is donated)."""
    # The int layer index and the (pages, offsets) arrays are all advanced indices, so the indexed
    # view is [T, KVH, D] — the layout k_new already has.
    k = cache.k.at[layer, :, pages, offsets].set(k_new.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[layer, :, pages, offsets].set(v_new.astype(cache.v.dtype), mode="drop")
    return KVCache(k=k, v=v)
