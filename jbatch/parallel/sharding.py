"""Sharding rules: which axis of every param, of the KV pool and of the engine state is split
over the mesh axis ``tp`` (Megatron-style tensor parallelism, laid out for XLA SPMD).

* Attention: ``wq``/``wk``/``wv`` (and their biases) are column-parallel over heads, ``wo`` is
  row-parallel over heads: each shard computes its heads' attention, and one all-reduce after
  ``wo`` sums the shards' partial outputs.
* MLP: ``w_gate``/``w_up`` column-parallel over the intermediate dimension, ``w_down``
  row-parallel (one all-reduce).
* Mixture of experts (the ``moe`` and ``dense_mlp`` groups of ``jbatch.moe_checkpoint``): the
  same inside every expert — ``expert_gate``/``expert_up`` ``[L, N, E, F]`` split on F,
  ``expert_down`` ``[L, N, F, E]`` on F, one all-reduce per layer
  (``jbatch.parallel.experts``); the router is replicated.
* Vocabulary: ``embed`` and ``lm_head`` split over vocab rows (a vocab not divisible by ``tp``
  stays replicated).
* KV pool ``[P, S, KVH, D]``: split over KV heads (axis 2), after the KV-head replication of
  :func:`jbatch.parallel.mesh.sharded_model_config` when ``tp`` exceeds the KV heads. Page ids
  and page tables are the same on every shard. An 8-bit pool's scales ``[P, S, KVH]`` split the
  same axis (:func:`kv_spec`): a shard holds exactly its own heads' scales.
* Int8 weight scales (``wq_scale``...): split like their weight's output axis; replicated for
  row-parallel weights (``wo``, ``w_down``), whose split axis is the one the scales reduce.
* Everything else (norms, slot arrays, page tables, sampling state): replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from jbatch.models import quant
from jbatch.models.config import ModelConfig

TP = "tp"


def kv_spec(ndim: int) -> P:
    """A KV buffer's spec: KV-head axis 2 split (pool data: 4-D, 8-bit pool scales: 3-D)."""
    return P(None, None, TP, *[None] * (ndim - 3))


KV_POOL_SPEC = kv_spec(4)  # [pages, page_size, kv_heads, head_dim]


# layer param -> axis split over tp (None: replicated)
_LAYER_AXES = {
    "wq": 2, "wk": 2, "wv": 2, "bq": 1, "bk": 1, "bv": 1,
    "wo": 1,
    "w_gate": 2, "w_up": 2, "b_gate": 1, "b_up": 1,
    "w_down": 1,
    "expert_gate": 3, "expert_up": 3, "expert_down": 2,
}  # fmt: skip


def _spec(ndim: int, axis: int | None) -> P:
    if axis is None:
        return P()
    return P(*[TP if i == axis else None for i in range(ndim)])


def param_specs(shapes: dict, tp: int) -> dict:
    """PartitionSpecs for a params tree (or :func:`expected_param_shapes` tree) of the *sharded*
    model config; a dimension that ``tp`` does not divide stays replicated."""

    def spec(shape, axis):
        shape = tuple(getattr(shape, "shape", shape))
        if axis is not None and shape[axis] % tp:
            axis = None
        return _spec(len(shape), axis)

    top_axes = {"embed": 0, "lm_head": 0}
    out: dict[str, Any] = {}
    for key, value in shapes.items():
        if isinstance(value, dict):  # "layers" and a MoE model's MLP groups
            out[key] = {k: spec(v, _axis(k, value, _LAYER_AXES)) for k, v in value.items()}
        else:
            out[key] = spec(value, _axis(key, shapes, top_axes))
    return out


def _axis(key: str, tree: dict, axes: dict[str, int]) -> int | None:
    """The axis of param ``key`` split over tp; a quantization scale follows its weight's split
    unless that is the contraction axis (row-parallel weights: replicated scales)."""
    weight = quant.weight_of(key)
    if weight is None:
        return axes.get(key)
    ndim = len(tuple(getattr(tree[weight], "shape", tree[weight])))
    return quant.scale_axis(axes.get(weight), ndim, weight)


def param_shardings(mesh: Mesh, shapes: dict) -> dict:
    """``NamedSharding`` of every param on ``mesh`` (see :func:`param_specs`)."""
    specs = param_specs(shapes, mesh.shape[TP])
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def expand_kv_heads(
    w: Float[Array, "... kvh_d"], num_kv_heads: int, replication: int
) -> Float[Array, "... kvh_r_d"]:
    """Repeat each KV head's columns ``replication`` times along the last axis (head-major), so
    expanded head ``m`` is original head ``m // replication``."""
    if replication == 1:
        return w
    xp = np if isinstance(w, np.ndarray) else jnp
    lead, d = w.shape[:-1], w.shape[-1] // num_kv_heads
    w = w.reshape(*lead, num_kv_heads, d)
    return xp.repeat(w, replication, axis=-2).reshape(*lead, num_kv_heads * replication * d)


def shard_params(params: dict, model_cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place an in-memory params tree onto ``mesh`` (KV heads replicated as needed). For
    checkpoints on disk prefer :func:`jbatch.parallel.loading.load_params_sharded`, which never
    holds a whole param on one device."""
    from jbatch.parallel.mesh import kv_replication

    r = kv_replication(model_cfg, mesh.shape[TP])
    layers = dict(params["layers"])
    for key in ("wk", "wv", "bk", "bv", "wk_scale", "wv_scale"):
        if key in layers:
            layers[key] = expand_kv_heads(layers[key], model_cfg.num_kv_heads, r)
    params = {**params, "layers": layers}
    return jax.device_put(params, param_shardings(mesh, params))


def state_shardings(mesh: Mesh, state_shape: Any) -> Any:
    """Shardings of an ``EngineState`` (or of a ``SwappedSlot``): KV buffers split over KV heads,
    every other field replicated."""
    from jbatch.engine.state import EngineState
    from jbatch.engine.swap import SwappedSlot

    rep = NamedSharding(mesh, P())
    pools = lambda cache: jax.tree.map(lambda a: NamedSharding(mesh, kv_spec(len(a.shape))), cache)
    if isinstance(state_shape, EngineState):
        rest = jax.tree.map(lambda _: rep, state_shape.replace(cache=None))
        return rest.replace(cache=pools(state_shape.cache))
    if isinstance(state_shape, SwappedSlot):
        rest = jax.tree.map(lambda _: rep, state_shape.replace(kv=None))
        return rest.replace(kv=pools(state_shape.kv))
    raise TypeError(f"no sharding rule for {type(state_shape).__name__}")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
