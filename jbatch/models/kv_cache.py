"""The paged KV pool: one K and one V array per layer, each ``[P, S, KVH, D]``.

Layout (pages, page size, KV heads, head dim), one buffer per layer:

* One buffer per layer (not one stacked ``[L, ...]`` array): a layer's attention reads its pool
  directly, where slicing a stacked array would materialise a copy of the layer's whole pool
  every step, and each buffer is updated in place when the state is donated.

* A page is one contiguous ``S x KVH x D`` block: a token's K/V write is one contiguous row, a
  sequence's gathered pages are already ``[tokens, KVH, D]`` (no transpose), and a GPU kernel
  loads whole pages for all the heads of a GQA group — the layout of vLLM's flash-attention
  cache and of JAX's TPU ragged paged attention.
* Tensor parallelism shards the KV-head axis (axis 2): every chip holds its own heads' slice of
  every page, page ids are identical on all chips, and the page tables stay replicated.
* Page ids are shared by all layers: a sequence's page table says where its tokens live in every
  layer at once.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from jbatch.models.config import ModelConfig

LayerPool = Float[Array, "pages page_size kv_heads head_dim"]


@struct.dataclass
class KVCache:
    k: tuple[LayerPool, ...]  # one per layer
    v: tuple[LayerPool, ...]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @classmethod
    def full(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, value=0.0) -> KVCache:
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        new = lambda: tuple(jnp.full(shape, value, dtype) for _ in range(cfg.num_layers))
        return cls(k=new(), v=new())

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> KVCache:
        return cls.full(cfg, num_pages, page_size, dtype, 0.0)


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

    def put(pools, new):
        pool = pools[layer]  # [P, S, KVH, D]; pool[pages, offsets] is [T, KVH, D] like new
        pool = pool.at[pages, offsets].set(new.astype(pool.dtype), mode="drop")
        return (*pools[:layer], pool, *pools[layer + 1 :])

    return KVCache(k=put(cache.k, k_new), v=put(cache.v, v_new))
