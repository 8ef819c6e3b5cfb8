"""Sharded loading: every device's slice of every param is read from safetensors directly.

Each param becomes one global ``jax.Array`` built by :func:`jax.make_array_from_callback`: the
callback receives the index of one device's shard and reads only those rows/columns of the HF
tensors (per layer) through a read-only ``np.memmap`` of the file, transposes and casts them.
No param is ever materialised whole on one device or in host memory (the file pages a shard
touches are mapped only while it is read), so peak host memory is about one device's shards of
one param above what the devices hold — on a multi-host slice every process reads only the
shards of its own devices. KV heads are replicated on the fly when ``tp`` exceeds them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jbatch.checkpoint import (
    _FLOAT_TAGS,
    _LAYER_TENSORS,
    _TOP_TENSORS,
    CheckpointError,
    Params,
    _resolve_dtype,
    _weight_map,
    expected_param_shapes,
)
from jbatch.models.config import ModelConfig
from jbatch.models.moe_config import mlp_groups
from jbatch.moe_checkpoint import read_param
from jbatch.parallel.mesh import kv_replication, sharded_model_config
from jbatch.parallel.sharding import TP, param_shardings

_KV_KEYS = ("wk", "wv", "bk", "bv")


class _Files:
    """Memory-maps single tensors of a set of safetensors files (headers parsed once)."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.weight_map = _weight_map(model_dir)
        self._headers: dict[Path, tuple[int, dict]] = {}

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        path = self.weight_map.get(name)
        if path is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} not found")
        if path not in self._headers:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                self._headers[path] = (8 + n, json.loads(fh.read(n)))
        base, header = self._headers[path]
        if name not in header:
            raise CheckpointError(f"{path}: tensor {name!r} not found in file")
        meta = header[name]
        if meta["dtype"] not in _FLOAT_TAGS:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {meta['dtype']}")
        if tuple(meta["shape"]) != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(meta['shape'])}, expected {shape}"
            )
        start, end = meta["data_offsets"]
        raw = np.memmap(path, np.uint8, "r", offset=base + start, shape=(end - start,))
        return raw.view(_FLOAT_TAGS[meta["dtype"]]).reshape(shape)


def _as_index(idx: np.ndarray) -> slice | np.ndarray:
    """A contiguous index array as a slice (a view of the memmap, no fancy-index copy)."""
    if len(idx) and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
        return slice(int(idx[0]), int(idx[0]) + len(idx))
    return idx


def _kv_rows(idx: np.ndarray, head_dim: int, replication: int) -> np.ndarray:
    """Rows of the original K/V projection behind columns ``idx`` of the replicated one."""
    head = idx // head_dim
    return (head // replication) * head_dim + idx % head_dim


def load_params_sharded(
    model_dir: str | Path, model_cfg: ModelConfig, mesh: Mesh, dtype: str = "float32"
) -> Params:
    """Load HF safetensors straight into shards on ``mesh`` (rules of
    :func:`jbatch.parallel.sharding.param_specs`). ``model_cfg`` is the checkpoint's config; the
    result is a params tree of ``sharded_model_config(model_cfg, tp)``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory not found")
    target = _resolve_dtype(dtype, str(model_dir))
    tp = mesh.shape[TP]
    r, d = kv_replication(model_cfg, tp), model_cfg.head_dim
    scfg = sharded_model_config(model_cfg, tp)
    shapes = expected_param_shapes(scfg)
    shardings = param_shardings(mesh, shapes)
    files = _Files(model_dir)

    def read(name: str, hf_shape: tuple, linear: bool, kv: bool, index: tuple) -> np.ndarray:
        """One layer's (or a top-level) tensor, restricted to ``index`` of the jbatch layout."""
        jb_shape = hf_shape[::-1] if linear else hf_shape
        if kv:  # the out axis (last in jbatch layout) is in replicated-head space
            jb_shape = (*jb_shape[:-1], jb_shape[-1] * r)
        idx = [np.arange(n)[s] for n, s in zip(jb_shape, index)]
        if kv:
            idx[-1] = _kv_rows(idx[-1], d, r)
        part = files.tensor(name, hf_shape)
        for axis, ix in enumerate(idx[::-1] if linear else idx):  # HF linear layout: [out, in]
            part = part[(slice(None),) * axis + (_as_index(ix),)]
        out = np.asarray(part.T if linear else part, dtype=target)
        del part
        return out

    def top(key: str):
        hf_name, linear = _TOP_TENSORS[key]
        shape = shapes[key]
        hf_shape = shape[::-1] if linear else shape
        cb = lambda index: read(hf_name, hf_shape, linear, False, index)
        return jax.make_array_from_callback(shape, shardings[key], cb)

    def layer(key: str):
        suffix, linear = _LAYER_TENSORS[key]
        shape, kv = shapes["layers"][key], key in _KV_KEYS
        per_layer = list(shape[1:])
        if kv:
            per_layer[-1] //= r  # the checkpoint holds the original KV heads
        hf_shape = tuple(per_layer[::-1] if linear else per_layer)

        def cb(index):
            layers = range(shape[0])[index[0]]
            parts = [
                read(f"model.layers.{i}.{suffix}", hf_shape, linear, kv, index[1:]) for i in layers
            ]
            return np.stack(parts)

        return jax.make_array_from_callback(shape, shardings["layers"][key], cb)

    def group_param(group: str, key: str):  # a MoE model's MLP groups (jbatch.moe_checkpoint)
        shape, layer_ids = shapes[group][key], mlp_groups(model_cfg)[group]

        def cb(index):
            parts = [
                read_param(files.tensor, files.weight_map, model_cfg, group, key, i, index[1:])
                for i in layer_ids[index[0]]
            ]
            return np.stack(parts).astype(target, copy=False)

        return jax.make_array_from_callback(shape, shardings[group][key], cb)

    params: Params = {k: top(k) for k in ("embed", "final_norm", "lm_head") if k in shapes}
    params["layers"] = {k: layer(k) for k in shapes["layers"]}
    for group in mlp_groups(model_cfg):
        params[group] = {k: group_param(group, k) for k in shapes[group]}
    return {k: params[k] for k in shapes}


def params_bytes(params: Params) -> int:
    """Total bytes of a params tree (all shards of every param, replicas counted once)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
