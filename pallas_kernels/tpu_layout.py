"""The KV pool layout JAX's TPU ragged paged attention kernel reads, and conversions to it.

JAX's kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) reads ONE array per
layer, ``kv_pages [P, S, 2 * KVHp, Dp]``: K of head ``h`` at combined head ``2h``, V at ``2h + 1``.
Two constraints of that kernel (jax 0.10.2) force padding:

* **Head dim** a multiple of 128 (its softmax statistics are 128 lanes wide and broadcast over
  the head dim): ``Dp = ceil(D / 128) * 128``; the padded lanes hold zeros, so ``q . k`` and the
  output's real lanes are unchanged (the softmax scale stays ``D ** -0.5``, passed explicitly).
* **Combined heads "XLA fully tiled"** for the pool dtype's packing (32 bits / itemsize): with
  ``n = 2 * KVHp / packing``, ``n`` in (1, 2, 4, 8) or a multiple of 8. ``KVHp`` is the smallest
  head count >= KVH that satisfies it (3 -> 4, 5 -> 8); padded KV heads hold zeros and get
  zero query heads, whose outputs are dropped.

See docs/architecture.md, "TPU attention", for why the engine stores this layout on TPU instead
of converting per step, and what it costs.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

LANES = 128  # the kernel's head dim granule


def _fully_tiled(combined_heads: int, packing: int) -> bool:
    if combined_heads % packing:
        return False
    n = combined_heads // packing
    return n in (1, 2, 4, 8) or n % 8 == 0


@dataclasses.dataclass(frozen=True)
class TpuPoolLayout:
    """Real and padded head sizes of one model's pool in the kernel's layout."""

    num_kv_heads: int
    head_dim: int
    kv_heads_padded: int
    head_dim_padded: int

    @classmethod
    def of(cls, num_kv_heads: int, head_dim: int, dtype) -> TpuPoolLayout:
        if num_kv_heads < 1 or head_dim < 1:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} and head_dim={head_dim} must be positive"
            )
        packing = max(1, 4 // jnp.dtype(dtype).itemsize)
        kvhp = num_kv_heads
        while not _fully_tiled(2 * kvhp, packing):
            kvhp += 1
        return cls(num_kv_heads, head_dim, kvhp, -(-head_dim // LANES) * LANES)

    @property
    def combined_heads(self) -> int:
        return 2 * self.kv_heads_padded

    @property
    def padding_factor(self) -> float:
        """Pool bytes of this layout over the compact ``[P, S, KVH, D]`` K and V pair's."""
        return (self.kv_heads_padded * self.head_dim_padded) / (self.num_kv_heads * self.head_dim)


def interleave(
    k: Shaped[Array, "*rows kvh d"], v: Shaped[Array, "*rows kvh d"], layout: TpuPoolLayout
) -> Shaped[Array, "*rows ckvh dp"]:
    """K and V rows as the kernel's combined rows: heads padded, K at even, V at odd heads."""
    kvh, d = k.shape[-2:]
    if (kvh, d) != (layout.num_kv_heads, layout.head_dim) or k.shape != v.shape:
        raise ValueError(
            f"k {k.shape} / v {v.shape} do not end in the layout's (KVH, D) = "
            f"({layout.num_kv_heads}, {layout.head_dim})"
        )
    pad = [(0, 0)] * (k.ndim - 2) + [
        (0, layout.kv_heads_padded - kvh),
        (0, layout.head_dim_padded - d),
    ]
    kv = jnp.stack([jnp.pad(k, pad), jnp.pad(v, pad)], axis=-2)  # [..., KVHp, 2, Dp]
    return kv.reshape(*k.shape[:-2], layout.combined_heads, layout.head_dim_padded)


def split(
    kv: Shaped[Array, "*rows ckvh dp"], layout: TpuPoolLayout
) -> tuple[Shaped[Array, "*rows kvh d"], Shaped[Array, "*rows kvh d"]]:
    """The compact K and V views of combined rows (what the XLA and GPU paths read)."""
    kvh, d = layout.num_kv_heads, layout.head_dim
    return kv[..., 0 : 2 * kvh : 2, :d], kv[..., 1 : 2 * kvh : 2, :d]


def pad_query_heads(q: Float[Array, "t h d"], layout: TpuPoolLayout) -> Float[Array, "t hp dp"]:
    """Queries with zero heads for the padded KV heads (each KV head keeps its G query heads)
    and zero lanes up to the padded head dim."""
    t, h, d = q.shape
    g = h // layout.num_kv_heads
    q = q.reshape(t, layout.num_kv_heads, g, d)
    pad = ((0, 0), (0, layout.kv_heads_padded - layout.num_kv_heads), (0, 0))
    q = jnp.pad(q, (*pad, (0, layout.head_dim_padded - d)))
    return q.reshape(t, layout.kv_heads_padded * g, layout.head_dim_padded)


def unpad_query_heads(
    o: Float[Array, "t hp dp"], layout: TpuPoolLayout, num_heads: int
) -> Float[Array, "t h d"]:
    """The real heads and lanes of a padded-head output."""
    t = o.shape[0]
    g = num_heads // layout.num_kv_heads
    o = o.reshape(t, layout.kv_heads_padded, g, layout.head_dim_padded)
    return o[:, : layout.num_kv_heads, :, : layout.head_dim].reshape(t, num_heads, -1)
