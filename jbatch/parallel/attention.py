"""Attention per shard: the model's paged attention under ``jax.shard_map`` over ``tp``.

Each shard holds whole query heads (``q`` split on its head axis) and the KV heads they read
(the pool split on axis 2), so attention needs no communication: ``shard_map`` runs the
unchanged single-device attention — the XLA path, or a Pallas kernel, which XLA's SPMD
partitioner could not split by itself (a kernel is an opaque custom call) — on each shard's
heads. Page tables, positions and slots are replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jbatch.models import llama
from jbatch.models.kv_cache import KVCache
from jbatch.parallel.sharding import TP, kv_spec


def sharded_attention(mesh: Mesh) -> Callable:
    """A drop-in for ``llama._attention`` (``forward(..., attention=...)``) that runs it per
    shard of ``mesh``'s ``tp`` axis."""

    def attend(q, cache: KVCache, layer: int, *rest):
        arrays = [i for i, a in enumerate(rest) if isinstance(a, jax.Array | jax.core.Tracer)]

        def local(q, pool, *arr):
            args = list(rest)
            for i, a in zip(arrays, arr):
                args[i] = a
            return llama._attention(q, pool, 0, *args)

        pool = cache.layer(layer)  # this layer's K/V (and 8-bit scales), split on KV heads
        pool_specs = jax.tree.map(lambda a: kv_spec(a.ndim), pool)
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(None, TP, None), pool_specs, *[P()] * len(arrays)),
            out_specs=P(None, TP, None),
            check_vma=False,
        )
        return fn(q, pool, *[rest[i] for i in arrays])

    return attend
