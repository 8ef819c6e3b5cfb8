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

from jbatch.checkpoint import _FLOAT_TAGS, Params, _ordered, _resolve_dtype, _weight_map
from jbatch.models.config import ModelConfig
from jbatch.models.moe_config import mlp_groups
from jbatch.models.quant import WeightQuant, contraction_axis, quantize, scale_key
from jbatch.models.quant import param_shapes as quant_param_shapes
from jbatch.moe_checkpoint import read_param
from jbatch.parallel.mesh import kv_replication, sharded_model_config
from jbatch.parallel.sharding import TP, param_shardings
from jbatch.param_layout import (
    _TOP_TENSORS,
    CheckpointError,
    Source,
    expected_param_shapes,
    layer_sources,
    top_name,
    weight_prefix,
)

_KV_KEYS = ("wk", "wv", "bk", "bv")  # their scales follow the weights


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
    model_dir: str | Path,
    model_cfg: ModelConfig,
    mesh: Mesh,
    dtype: str = "float32",
    quant: WeightQuant | None = None,
) -> Params:
    """Load HF safetensors straight into shards on ``mesh`` (rules of
    :func:`jbatch.parallel.sharding.param_specs`). ``model_cfg`` is the checkpoint's config; the
    result is a params tree of ``sharded_model_config(model_cfg, tp)``. ``quant``: the weights it
    names are quantized shard by shard as they are read (a shard split over a weight's
    contraction axis reads that axis whole to find its per-channel scales)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory not found")
    target = _resolve_dtype(dtype, str(model_dir))
    tp = mesh.shape[TP]
    r, d = kv_replication(model_cfg, tp), model_cfg.head_dim
    scfg = sharded_model_config(model_cfg, tp)
    shapes = expected_param_shapes(scfg)
    if quant is not None:
        shapes = quant_param_shapes(shapes, quant)
    shardings = param_shardings(mesh, shapes)
    files = _Files(model_dir)

    sources = layer_sources(model_cfg)
    prefix = weight_prefix(files.weight_map, str(model_dir))

    def read(name: str, source: Source, jb_shape: tuple, kv: bool, index: tuple) -> np.ndarray:
        """One layer's (or a top-level) tensor of jbatch shape ``jb_shape`` (the checkpoint's
        KV heads), restricted to ``index`` of the jbatch layout (KV heads replicated)."""
        linear = source.linear
        if kv:  # the out axis (last in jbatch layout) is in replicated-head space
            jb_shape = (*jb_shape[:-1], jb_shape[-1] * r)
        idx = [np.arange(n)[s] for n, s in zip(jb_shape, index)]
        if kv:
            idx[-1] = _kv_rows(idx[-1], d, r)
        hf_jb_shape = (*jb_shape[:-1], jb_shape[-1] // r) if kv else jb_shape
        part = source.take(files.tensor(name, source.hf_shape(hf_jb_shape)))
        for axis, ix in enumerate(idx[::-1] if linear else idx):  # HF linear layout: [out, in]
            part = part[(slice(None),) * axis + (_as_index(ix),)]
        out = np.asarray(part.T if linear else part, dtype=target)
        del part
        return out

    def read_as(kind: str, key: str, *args) -> np.ndarray:
        """``read`` as param ``kind``: "float", "int8" (values) or "scale" (their scales, whose
        ``index`` lacks the contraction axis)."""
        *head, index = args
        if kind == "float":
            return read(*head, index)
        c = contraction_axis(key) % (len(index) + (kind == "scale"))
        whole = index[:c] + (slice(None),) + index[c + (kind == "int8") :]
        q, scale = quantize(read(*head, whole), c)
        return scale if kind == "scale" else q[(slice(None),) * c + (index[c],)]

    def kinds(key: str, quantized: bool) -> dict[str, str]:
        return {key: "int8", scale_key(key): "scale"} if quantized else {key: "float"}

    def top(key: str) -> dict:
        source, shape = _TOP_TENSORS[key], shapes[key]
        quantized = quant is not None and key in quant.top_keys(shapes)
        out = {}
        for name, kind in kinds(key, quantized).items():
            cb = lambda index, kind=kind: read_as(
                kind, key, top_name(key, prefix), source, shape, False, index
            )
            out[name] = jax.make_array_from_callback(shapes[name], shardings[name], cb)
        return out

    def layer(key: str) -> dict:
        source, kv = sources[key], key in _KV_KEYS
        per_layer = list(shapes["layers"][key][1:])
        if kv:
            per_layer[-1] //= r  # the checkpoint holds the original KV heads
        quantized = quant is not None and quant.layer_key(key)
        out = {}
        for name, kind in kinds(key, quantized).items():
            shape = shapes["layers"][name]

            def cb(index, kind=kind):
                layers = range(scfg.num_layers)[index[0]]
                return np.stack([
                    read_as(kind, key, f"{prefix}layers.{i}.{source.name}", source,
                            tuple(per_layer), kv, index[1:])
                    for i in layers
                ])  # fmt: skip

            out[name] = jax.make_array_from_callback(shape, shardings["layers"][name], cb)
        return out

    def group_param(group: str, key: str):  # a MoE model's MLP groups (jbatch.moe_checkpoint)
        shape, layer_ids = shapes[group][key], mlp_groups(model_cfg)[group]

        def cb(index):
            parts = [
                read_param(files.tensor, files.weight_map, model_cfg, group, key, i, index[1:])
                for i in layer_ids[index[0]]
            ]
            return np.stack(parts).astype(target, copy=False)

        return jax.make_array_from_callback(shape, shardings[group][key], cb)

    params: Params = {}
    for key in ("embed", "final_norm", "lm_head"):
        if key in shapes:
            params.update(top(key))
    params["layers"] = {}
    for key in expected_param_shapes(scfg)["layers"]:
        params["layers"].update(layer(key))
    for group in mlp_groups(model_cfg):
        params[group] = {k: group_param(group, k) for k in shapes[group]}
    return _ordered(params)


def params_bytes(params: Params) -> int:
    """Total bytes of a params tree (all shards of every param, replicas counted once)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
