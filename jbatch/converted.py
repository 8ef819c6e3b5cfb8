"""Converted checkpoints: a Hugging Face folder rewritten as an orbax checkpoint of jbatch params.

``jbatch convert HF_DIR OUT_DIR`` (:func:`convert`) writes::

    OUT_DIR/params/                 orbax checkpoint: the params tree in the engine's layout
                                    (stacked layers, [in, out] linears, MoE groups, int8 weights
                                    and their scales), in the chosen dtype, with orbax's
                                    sharding metadata
    OUT_DIR/jbatch_checkpoint.json  ConvertedMeta: layout version, dtype, quantization, KV heads
    OUT_DIR/config.json, tokenizer files, generation_config.json   copied from HF_DIR

``LLM(OUT_DIR)`` restores it (:func:`load_weights`) straight into the engine's shardings: with a
mesh, orbax reads each device's own slices, so no process holds a whole param on the host.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jbatch.checkpoint import (
    _FLOAT_TAGS,
    Params,
    _flatten,
    _resolve_dtype,
    _weight_map,
    load_params,
    saved_tree,
)
from jbatch.engine.config import DTYPES, EngineConfig
from jbatch.models.config import ModelConfig
from jbatch.models.quant import QUANT_MODES, WeightQuant, check_checkpoint, weight_of
from jbatch.models.quant import param_shapes as quant_param_shapes
from jbatch.param_layout import CheckpointError, expected_param_shapes, weight_prefix

META_FILE = "jbatch_checkpoint.json"
PARAMS_DIR = "params"
LAYOUT_VERSION = 1  # bump when the params layout changes: older conversions are refused
FORMAT = "jbatch-orbax"
# Copied beside the params when HF_DIR has them (config.json is required).
BESIDE = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "tokenizer.model",
)  # fmt: skip
_TAG_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float32"}
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConvertedMeta:
    """What ``jbatch_checkpoint.json`` records about the params beside it."""

    dtype: str
    quantization: str | None
    quantize_lm_head: bool
    num_kv_heads: int  # as stored: more than the model's when converted for a larger --tp
    tp: int
    layout_version: int = LAYOUT_VERSION
    format: str = FORMAT

    def __post_init__(self):
        if self.format != FORMAT:
            raise ValueError(f"format={self.format!r} is not a jbatch checkpoint ({FORMAT!r})")
        if self.layout_version != LAYOUT_VERSION:
            raise ValueError(
                f"layout_version={self.layout_version} (this jbatch reads {LAYOUT_VERSION}): "
                f"convert the Hugging Face folder again with `jbatch convert`"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if self.quantization is not None and self.quantization not in QUANT_MODES:
            raise ValueError(f"quantization={self.quantization!r} must be one of {QUANT_MODES}")

    @property
    def weight_quant(self) -> WeightQuant | None:
        if self.quantization is None:
            return None
        return WeightQuant(self.quantization, self.quantize_lm_head)

    @classmethod
    def read(cls, model_dir: str | Path) -> ConvertedMeta:
        path = Path(model_dir) / META_FILE
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (json.JSONDecodeError, TypeError) as e:
            raise CheckpointError(f"{path}: not a valid jbatch checkpoint file ({e})") from e


def is_converted(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a checkpoint written by :func:`convert`."""
    return (Path(model_dir) / META_FILE).is_file()


def stored_dtype(hf_dir: str | Path) -> str:
    """The dtype the checkpoint's embedding is stored in (float64 read as float32)."""
    hf_dir = Path(hf_dir)
    weight_map = _weight_map(hf_dir)
    name = weight_prefix(weight_map, str(hf_dir)) + "embed_tokens.weight"
    with open(weight_map[name], "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        tag = json.loads(fh.read(n))[name]["dtype"]
    if tag not in _FLOAT_TAGS:
        raise CheckpointError(f"{weight_map[name]}: tensor {name!r} has dtype {tag}")
    return _TAG_DTYPES[tag]


def _check_out_dir(out_dir: Path, hf_dir: Path) -> None:
    if out_dir.resolve() == hf_dir.resolve():
        raise ValueError(f"OUT_DIR {out_dir} is the Hugging Face folder itself; pick another")
    if out_dir.exists() and any(out_dir.iterdir()) and not is_converted(out_dir):
        raise ValueError(
            f"OUT_DIR {out_dir} exists and is not a jbatch checkpoint; not touching it"
        )


def convert(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    tp: int = 1,
) -> Path:
    """Convert the HF folder ``hf_dir`` into a jbatch checkpoint at ``out_dir`` (see the module
    docstring); ``dtype`` None keeps the stored one. With ``tp > 1`` the params are read sharded
    over ``tp`` devices (each reads and writes only its slices), KV heads replicated as that
    ``tp`` needs. Returns ``out_dir``."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json (not a Hugging Face model folder)")
    _check_out_dir(out_dir, hf_dir)
    cfg = ModelConfig.from_file(hf_dir / "config.json")
    dtype = dtype or stored_dtype(hf_dir)
    _resolve_dtype(dtype, str(hf_dir))
    wq = None if quantization is None else WeightQuant(quantization, quantize_lm_head)
    if wq is None and quantize_lm_head:
        raise ValueError("quantize_lm_head=True needs quantization (e.g. 'int8')")
    check_checkpoint(hf_dir / "config.json", wq, cfg.num_experts)
    t0 = time.perf_counter()
    if tp == 1:
        params, kv_heads = load_params(hf_dir, cfg, dtype, wq), cfg.num_kv_heads
    else:
        from jbatch.parallel.loading import load_params_sharded
        from jbatch.parallel.mesh import make_mesh, sharded_model_config

        mesh = make_mesh(tp, 1, jax.devices()[:tp])
        params = load_params_sharded(hf_dir, cfg, mesh, dtype, wq)
        kv_heads = sharded_model_config(cfg, tp).num_kv_heads
    t_read = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_FILE).unlink(missing_ok=True)  # written last: a failed rewrite is no checkpoint
    _save(out_dir / PARAMS_DIR, params)
    for name in BESIDE:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out_dir / name)
    meta = ConvertedMeta(dtype, quantization, bool(quantize_lm_head), kv_heads, tp)
    (out_dir / META_FILE).write_text(json.dumps(dataclasses.asdict(meta), indent=2) + "\n")
    size = sum(a.nbytes for a in jax.tree.leaves(params))
    log.info(
        "converted %s -> %s: %.1f MB of params (%s, quantization=%s, tp=%d); read %.2f s, "
        "wrote %.2f s", hf_dir, out_dir, size / 1e6, dtype, quantization, tp, t_read,
        time.perf_counter() - t0 - t_read,
    )  # fmt: skip
    return out_dir


def _save(path: Path, params: Params) -> None:
    """Save with orbax, uncompressed: weights barely compress, and zstd slows every restore
    (SmolLM2-135M's shape on CPU: 1.8 s compressed vs 1.3 s; docs/benchmarks.md)."""
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    try:
        ckptr.save(path.absolute(), args=ocp.args.PyTreeSave(params), force=True)
    finally:
        ckptr.close()


def engine_config(model_dir: str | Path, config: EngineConfig) -> EngineConfig:
    """``config`` for a converted checkpoint: its quantization when ``config`` names none; a
    ValueError when ``config`` asks for weights the checkpoint does not hold. Unchanged for an HF
    folder."""
    if not is_converted(model_dir):
        return config
    meta = ConvertedMeta.read(model_dir)
    if config.quantization is None and meta.quantization is not None:
        log.info("%s: weights stored quantized (%s): running them so", model_dir, meta.quantization)
        return dataclasses.replace(
            config, quantization=meta.quantization, quantize_lm_head=meta.quantize_lm_head
        )
    if config.weight_quant != meta.weight_quant:
        raise ValueError(
            f"quantization={config.quantization!r} (quantize_lm_head={config.quantize_lm_head}) "
            f"but {model_dir} was converted with quantization={meta.quantization!r} "
            f"(quantize_lm_head={meta.quantize_lm_head}); convert it again with those options"
        )
    return config


def _expected(meta: ConvertedMeta, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = expected_param_shapes(cfg)
    if meta.weight_quant is not None:
        shapes = quant_param_shapes(shapes, meta.weight_quant)
    return _flatten(shapes)


def restore(
    model_dir: str | Path, model_cfg: ModelConfig, dtype: str = "float32", mesh=None
) -> Params:
    """The params of converted checkpoint ``model_dir`` (``model_cfg``: the checkpoint's config),
    float params in ``dtype``; with ``mesh``, restored into the params shardings on it (a tree
    of ``sharded_model_config(model_cfg, tp)``), else onto the default device."""
    model_dir = Path(model_dir)
    meta = ConvertedMeta.read(model_dir)
    target = _resolve_dtype(dtype, str(model_dir))
    if mesh is None:
        cfg, tp = model_cfg, 1
    else:
        from jbatch.parallel.mesh import sharded_model_config
        from jbatch.parallel.sharding import TP

        tp = mesh.shape[TP]
        cfg = sharded_model_config(model_cfg, tp)
    if cfg.num_kv_heads != meta.num_kv_heads:
        raise ValueError(
            f"{model_dir} stores {meta.num_kv_heads} KV heads (converted with --tp {meta.tp}); "
            f"tp={tp} needs {cfg.num_kv_heads}: convert it again with --tp {tp}"
        )
    path = (model_dir / PARAMS_DIR).absolute()
    ckptr = ocp.StandardCheckpointer()
    try:
        tree = saved_tree(path, ckptr)
        saved, want = _flatten(tree), _expected(meta, cfg)
        if set(saved) != set(want) or any(tuple(saved[k].shape) != want[k] for k in want):
            diff = sorted(k for k in set(saved) | set(want) if k not in saved or k not in want)
            raise CheckpointError(f"{path}: params do not match {model_dir}/config.json ({diff})")
        shardings = _shardings(tree, mesh)
        abstract = jax.tree_util.tree_map_with_path(
            lambda p, m, s: jax.ShapeDtypeStruct(tuple(m.shape), _dtype(p, m, target), sharding=s),
            tree,
            shardings,
        )
        t0 = time.perf_counter()
        params = ckptr.restore(path, abstract)
    finally:
        ckptr.close()
    log.info("restored %s (%s as %s, tp=%d) in %.2f s", path, meta.dtype, dtype, tp,
             time.perf_counter() - t0)  # fmt: skip
    return params


def _dtype(path, m: Any, target: np.dtype):
    """A param's restored dtype: int8 weights and their scales as stored, floats ``target``."""
    name = str(getattr(path[-1], "key", path[-1]))
    if np.dtype(m.dtype) == np.int8 or weight_of(name) is not None:
        return m.dtype
    return target


def _shardings(tree: dict, mesh) -> Any:
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: one, tree)
    from jbatch.parallel.sharding import param_shardings

    shapes = jax.tree.map(lambda m: tuple(m.shape), tree)
    return param_shardings(mesh, shapes)


def load_weights(
    model_dir: str | Path, model_cfg: ModelConfig, config: EngineConfig, mesh=None
) -> Params:
    """The engine's params from ``model_dir``: a converted checkpoint (:func:`restore`) or a
    Hugging Face folder (``load_params``, or ``load_params_sharded`` with ``mesh``)."""
    if is_converted(model_dir):
        return restore(model_dir, model_cfg, config.dtype, mesh)
    if mesh is None:
        return load_params(model_dir, model_cfg, config.dtype, config.weight_quant)
    from jbatch.parallel.loading import load_params_sharded

    return load_params_sharded(model_dir, model_cfg, mesh, config.dtype, config.weight_quant)
