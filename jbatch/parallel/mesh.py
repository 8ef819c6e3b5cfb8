"""Device meshes for tensor (``tp``) and data (``dp``) parallelism, and whether a model fits.

A mesh has two named axes, ``("dp", "tp")``: ``dp`` engine replicas, each over ``tp`` devices
that split one copy of the model. Each replica runs on its own sub-mesh (``replica_meshes``), a
``(1, tp)`` mesh with the same axis names, so one set of sharding rules serves every replica.

KV heads and tensor parallelism: a shard must hold the KV heads its query heads read. With
``num_kv_heads % tp == 0`` each shard holds ``num_kv_heads / tp`` of them. With fewer KV heads
than shards (``tp % num_kv_heads == 0``) every KV head is **replicated** ``tp / num_kv_heads``
times: the K/V projections (and biases) are repeated head by head at load time, so the model
becomes an equivalent one with ``tp`` KV heads (query head ``j`` still reads a copy of KV head
``j // q_per_kv``) and each shard holds exactly the one KV head its query heads need. This is
vLLM's scheme; it costs ``tp / num_kv_heads`` times the KV memory in total, never more per chip
than one KV head per page row.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jbatch.models.config import ModelConfig

AXES = ("dp", "tp")


def kv_replication(model_cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head tensor parallelism over ``tp`` needs (1 = none); raises
    ``ValueError`` when the heads do not split over ``tp``."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    h, kvh = model_cfg.num_heads, model_cfg.num_kv_heads
    if h % tp:
        raise ValueError(
            f"tp={tp} must divide the model's num_attention_heads={h} (each shard runs whole "
            f"query heads); valid tp values: {[d for d in range(1, h + 1) if h % d == 0]}"
        )
    if kvh % tp == 0:
        return 1
    if tp % kvh == 0:
        return tp // kvh
    raise ValueError(
        f"tp={tp} and num_key_value_heads={kvh}: KV heads must either split evenly over tp "
        f"or be replicated a whole number of times (tp a multiple of {kvh})"
    )


def sharded_model_config(model_cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config of the model a ``tp``-way shard group runs: KV heads replicated if needed."""
    r = kv_replication(model_cfg, tp)
    if r == 1:
        return model_cfg
    return dataclasses.replace(model_cfg, num_kv_heads=model_cfg.num_kv_heads * r)


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A ``(dp, tp)`` mesh over ``devices`` (default: all devices, every process's).

    Raises ``ValueError`` when ``dp * tp`` does not match the number of devices available.
    """
    for name, value in (("tp", tp), ("dp", dp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    devices = list(jax.devices() if devices is None else devices)
    if dp * tp > len(devices):
        raise ValueError(
            f"dp={dp} x tp={tp} needs {dp * tp} devices but only {len(devices)} are available "
            f"({devices[0].platform if devices else 'none'}); on CPU, simulate more with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N"
        )
    devices = devices[: dp * tp]
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        # jax.make_mesh orders devices for the physical topology (ICI rings on TPU).
        return jax.make_mesh((dp, tp), AXES, axis_types=(AxisType.Auto,) * 2)
    return Mesh(np.array(devices).reshape(dp, tp), AXES, axis_types=(AxisType.Auto,) * 2)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``(1, tp)`` sub-mesh per data-parallel replica of ``mesh``."""
    auto = (AxisType.Auto,) * 2
    return [Mesh(mesh.devices[i : i + 1], AXES, axis_types=auto) for i in range(mesh.shape["dp"])]


def check_fits(model_cfg: ModelConfig, tp: int, dp: int = 1) -> None:
    """Raise ``ValueError`` if the model's heads cannot be split over ``tp`` or the devices
    cannot hold ``dp`` replicas of ``tp`` shards."""
    kv_replication(model_cfg, tp)
    make_mesh(tp, dp)
