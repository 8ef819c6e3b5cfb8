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
* An 8-bit pool (int8 / float8_e4m3fn data) also holds one bfloat16 scale per token and KV head
  and layer, ``[P, S, KVH]`` (:mod:`pallas_kernels.kv_quant`): a token's write quantizes its
  row and sets its scale, and every reader dequantizes. The scales share the pool's first three
  axes, so page ids, swaps (which gather/scatter whole pages of every leaf) and the KV-head
  sharding apply to them unchanged.
* **TPU kernel layout** (``tpu`` set, float pools on one device): ``k`` holds each layer's K and
  V interleaved and head-padded, ``[P, S, 2 * KVHp, Dp]`` (:mod:`pallas_kernels.tpu_layout`),
  ``v`` is empty; the other attention paths read :meth:`KVCache.pages` (strided views).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, Shaped

from jbatch.models.config import ModelConfig
from pallas_kernels.kv_quant import SCALE_DTYPE, is_quantized, quantize
from pallas_kernels.tpu_layout import TpuPoolLayout, interleave, split

LayerPool = Shaped[Array, "pages page_size kv_heads head_dim"]  # float, or 8-bit with scales
LayerScales = Float[Array, "pages page_size kv_heads"]


@struct.dataclass
class KVCache:
    k: tuple[LayerPool, ...]  # one per layer
    v: tuple[LayerPool, ...]
    k_scale: tuple[LayerScales, ...] | None = None  # one per layer when the pool is 8-bit
    v_scale: tuple[LayerScales, ...] | None = None
    tpu: TpuPoolLayout | None = struct.field(pytree_node=False, default=None)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def scales(self, layer: int) -> tuple[LayerScales | None, LayerScales | None]:
        """Layer ``layer``'s K and V scales (``None, None`` for a float pool)."""
        if not self.quantized:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def pages(self, layer: int) -> tuple[LayerPool, LayerPool]:
        """Layer ``layer``'s K and V pools as ``[P, S, KVH, D]`` (views in the TPU layout)."""
        if self.tpu is not None:
            return split(self.k[layer], self.tpu)
        return self.k[layer], self.v[layer]

    def tpu_pool(self, layer: int) -> tuple[Shaped[Array, "p s ckvh dp"], TpuPoolLayout]:
        """Layer ``layer`` in the TPU kernel's layout, and that layout. A compact pool is
        converted — a copy of the layer's whole pool, per call (why the engine stores the TPU
        layout instead: docs/architecture.md, "TPU attention")."""
        if self.tpu is not None:
            return self.k[layer], self.tpu
        if self.quantized:
            raise ValueError("the TPU kernel cannot read an 8-bit pool (per-token scales)")
        _, _, kvh, d = self.k[layer].shape
        lay = TpuPoolLayout.of(kvh, d, self.k[layer].dtype)
        return interleave(self.k[layer], self.v[layer], lay), lay

    def layer(self, layer: int) -> KVCache:
        """A one-layer cache holding layer ``layer``'s buffers (what per-shard attention reads)."""
        one = lambda t: None if t is None else (t[layer],) if t else ()
        return KVCache(*(one(t) for t in (self.k, self.v, self.k_scale, self.v_scale)), self.tpu)

    @classmethod
    def full(
        cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, value=0.0, tpu_layout=False
    ) -> KVCache:
        """A pool every entry of which reads as ``value`` (an 8-bit ``dtype``: data 0 or 1,
        scales ``value``, so NaN pools stay possible); ``tpu_layout``: the TPU kernel's layout
        (real entries ``value``, padding zeros)."""
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        layers = lambda shape, v, dt: tuple(jnp.full(shape, v, dt) for _ in range(cfg.num_layers))
        if tpu_layout:
            if is_quantized(dtype):
                raise ValueError(f"the TPU kernel layout holds float pools, not {dtype}")
            lay = TpuPoolLayout.of(cfg.num_kv_heads, cfg.head_dim, dtype)
            one = lambda: interleave(*(jnp.full(shape, value, dtype),) * 2, lay)
            return cls(k=tuple(one() for _ in range(cfg.num_layers)), v=(), tpu=lay)
        if not is_quantized(dtype):
            return cls(k=layers(shape, value, dtype), v=layers(shape, value, dtype))
        data = 0 if value == 0 else 1
        return cls(
            k=layers(shape, data, dtype),
            v=layers(shape, data, dtype),
            k_scale=layers(shape[:3], value, SCALE_DTYPE),
            v_scale=layers(shape[:3], value, SCALE_DTYPE),
        )

    @classmethod
    def zeros(
        cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, tpu_layout=False
    ) -> KVCache:
        return cls.full(cfg, num_pages, page_size, dtype, 0.0, tpu_layout)


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
    """Scatter one layer's new K/V rows into the pool (in place when the cache is donated); an
    8-bit pool stores each row quantized with its own scale."""

    def put(pools, new):
        pool = pools[layer]  # [P, S, KVH, D] (scales [P, S, KVH]); pool[pages, offsets] ~ new
        pool = pool.at[pages, offsets].set(new.astype(pool.dtype), mode="drop")
        return (*pools[:layer], pool, *pools[layer + 1 :])

    if cache.tpu is not None:  # one combined row per token
        return cache.replace(k=put(cache.k, interleave(k_new, v_new, cache.tpu)))
    if not cache.quantized:
        return KVCache(k=put(cache.k, k_new), v=put(cache.v, v_new))
    (kq, ks), (vq, vs) = (quantize(x, cache.k[layer].dtype) for x in (k_new, v_new))
    return KVCache(
        k=put(cache.k, kq), v=put(cache.v, vq), k_scale=put(cache.k_scale, ks),
        v_scale=put(cache.v_scale, vs),
    )  # fmt: skip


def bytes_per_token(cache: KVCache) -> float:
    """Pool bytes (data and scales, all layers) per token of capacity."""
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(cache))
    return total / (cache.num_pages * cache.page_size)
