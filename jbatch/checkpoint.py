"""Load Hugging Face safetensors checkpoints into jbatch's params pytree; orbax save/restore.

The layout (which params, their shapes, which HF tensor each comes from) is
``jbatch.param_layout``; this module reads files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import Float
from safetensors import safe_open

from jbatch.models.config import ModelConfig
from jbatch.models.moe_config import DENSE_MLP, MOE
from jbatch.models.quant import (
    HostStack,
    WeightQuant,
    cast_floats,
    head_key,
    quantize_top,
    scale_key,
    weight_of,
)
from jbatch.models.quant import param_shapes as quant_param_shapes
from jbatch.moe_checkpoint import iter_groups
from jbatch.param_layout import (
    _TOP_TENSORS,
    CheckpointError,
    Source,
    expected_param_shapes,
    layer_sources,
    top_name,
    weight_prefix,
)

Params = dict[str, Any]  # nested dict of Float[Array, "..."]
HostArray = Float[np.ndarray, "..."]

SUPPORTED_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
# safetensors dtype tags we accept as weights; BF16 is read from raw bytes (numpy lacks it).
_FLOAT_TAGS = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def _resolve_dtype(dtype: str | jnp.dtype, where: str) -> np.dtype:
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    except TypeError:
        name = str(dtype)
    if name not in SUPPORTED_DTYPES:
        raise CheckpointError(
            f"{where}: unsupported dtype {dtype!r} (supported: {', '.join(SUPPORTED_DTYPES)})"
        )
    return SUPPORTED_DTYPES[name]


def _weight_map(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the single file or the sharded index."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        with safe_open(str(single), framework="numpy") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from e
        files = {shard: model_dir / shard for shard in set(weight_map.values())}
        for shard, path in sorted(files.items()):
            if not path.is_file():
                raise CheckpointError(f"{index}: references shard file {shard!r} which is missing")
        return {name: files[shard] for name, shard in weight_map.items()}
    hint = ""
    if any(model_dir.glob("pytorch_model*.bin")):
        hint = " (found pytorch_model.bin: .bin/pytorch checkpoints are not supported)"
    raise CheckpointError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json found{hint}"
    )


class _Reader:
    """Reads single tensors from a set of safetensors files as numpy arrays."""

    def __init__(self, model_dir: Path, stack: contextlib.ExitStack):
        self.model_dir = model_dir
        self.weight_map = _weight_map(model_dir)
        self._stack = stack
        self._handles: dict[Path, Any] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), "numpy"))
        return self._handles[path]

    def _raw(self, path: Path, name: str, dtype) -> np.ndarray:
        """Read a tensor from the file's little-endian bytes (numpy's safe_open refuses bf16)."""
        if path not in self._headers:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                self._headers[path] = (8 + n, json.loads(fh.read(n)))
        base, header = self._headers[path]
        start, end = header[name]["data_offsets"]
        data = np.fromfile(path, dtype=np.uint8, count=end - start, offset=base + start)
        return data.view(dtype).reshape(header[name]["shape"])

    def get(self, name: str, shape: tuple[int, ...]) -> HostArray:
        """Return tensor ``name``, checking it is a float tensor of HF ``shape``."""
        path = self.weight_map.get(name)
        if path is None:
            searched = ", ".join(sorted({p.name for p in self.weight_map.values()}))
            raise CheckpointError(
                f"{self.model_dir}: tensor {name!r} not found (searched: {searched or 'no files'})"
            )
        try:
            sl = self._handle(path).get_slice(name)
        except Exception as e:  # the index claims a tensor that the shard lacks
            raise CheckpointError(f"{path}: tensor {name!r} not found in file ({e})") from e
        tag, actual = sl.get_dtype(), tuple(sl.get_shape())
        if tag not in _FLOAT_TAGS:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {tag}; only floating point weights "
                f"({', '.join(_FLOAT_TAGS)}) are supported"
            )
        if actual != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {actual}, expected {shape} (HF [out, in] order)"
            )
        if tag == "BF16":
            return self._raw(path, name, _FLOAT_TAGS[tag])
        return self._handle(path).get_tensor(name)


def load_params(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: str | jnp.dtype = "float32",
    quant: WeightQuant | None = None,
) -> Params:
    """Load HF safetensors weights from ``model_dir`` into the jbatch params pytree
    (``quant``: quantize the weights it names as they are read, see ``jbatch.models.quant``).

    Tensors are read one at a time, transposed/cast into a preallocated per-param host buffer
    and moved to a jax array, so peak host memory is about one stacked param on top of the
    params already converted.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory not found")
    target = _resolve_dtype(dtype, str(model_dir))
    shapes = expected_param_shapes(cfg)
    sources = layer_sources(cfg)

    def read(reader: _Reader, name: str, source: Source, shape: tuple[int, ...]) -> HostArray:
        t = source.take(reader.get(name, source.hf_shape(shape)))
        return t.T if source.linear else t

    params: Params = {"layers": {}}
    with contextlib.ExitStack() as stack:
        reader = _Reader(model_dir, stack)
        prefix = weight_prefix(reader.weight_map, str(model_dir))
        for key, source in _TOP_TENSORS.items():
            if key not in shapes:
                continue  # lm_head with tied embeddings: ignore lm_head.weight if present
            t = read(reader, top_name(key, prefix), source, shapes[key])
            params.update(quantize_top(key, t, target, quant, shapes))
            del t
        for key, shape in shapes["layers"].items():
            source = sources[key]
            buf = HostStack(key, shape, target, quant)
            for i in range(cfg.num_layers):
                buf[i] = read(reader, f"{prefix}layers.{i}.{source.name}", source, shape[1:])
            params["layers"].update(buf.arrays())
            del buf
        for group, key, buf in iter_groups(reader.get, reader.weight_map, cfg, target):
            params.setdefault(group, {})[key] = jnp.asarray(buf)
            del buf
    return _ordered(params)


def _ordered(params: Params) -> Params:
    """Top-level params in their canonical order (``*_scale`` after the weight it scales)."""
    keys = ("embed", "embed_scale", "layers", MOE, DENSE_MLP, "final_norm", "lm_head")
    return {k: params[k] for k in (*keys, "lm_head_scale") if k in params}


def load_model(
    model_dir: str | Path, dtype: str | jnp.dtype = "float32", quant: WeightQuant | None = None
) -> tuple[ModelConfig, Params]:
    """Read ``model_dir/config.json`` and the weights (quantized by ``quant``); returns
    ``(cfg, params)``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory not found")
    cfg = ModelConfig.from_file(model_dir / "config.json")
    return cfg, load_params(model_dir, cfg, dtype, quant)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Sampling defaults from ``generation_config.json`` (None where the file has no value)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def load_generation_config(model_dir: str | Path) -> GenerationConfig:
    """Read the optional ``generation_config.json``; eos/bos fall back to ``config.json``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory not found")
    gen = _read_json(model_dir / "generation_config.json")
    base = _read_json(model_dir / "config.json")
    eos = gen.get("eos_token_id", base.get("eos_token_id"))
    bos = gen.get("bos_token_id", base.get("bos_token_id"))

    def opt(key: str, cast):
        return None if gen.get(key) is None else cast(gen[key])

    return GenerationConfig(
        eos_token_ids=_ids(eos),
        bos_token_id=None if bos is None else int(bos),
        temperature=opt("temperature", float),
        top_p=opt("top_p", float),
        top_k=opt("top_k", int),
        repetition_penalty=opt("repetition_penalty", float),
        max_new_tokens=opt("max_new_tokens", int),
    )


def save_params(path: str | Path, params: Params) -> None:
    """Save ``params`` with orbax at ``path`` (made absolute), replacing any existing checkpoint."""
    path = Path(path).absolute()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, params, force=True)
    ckptr.wait_until_finished()
    ckptr.close()


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def saved_tree(path: Path, ckptr: ocp.StandardCheckpointer) -> dict:
    """The tree metadata (shapes, dtypes) of the orbax params checkpoint at ``path``."""
    try:
        meta = ckptr.metadata(path)
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable orbax checkpoint ({e})") from e
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path}: not an orbax params checkpoint (no tree metadata)")
    return dict(tree)


def restore_params(
    path: str | Path, cfg: ModelConfig, dtype: str | jnp.dtype = "float32"
) -> Params:
    """Restore an orbax checkpoint written by :func:`save_params`, validated against ``cfg``
    (quantized params come back quantized; the other params in ``dtype``)."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: checkpoint directory not found")
    target = _resolve_dtype(dtype, str(path))
    expected = expected_param_shapes(cfg)
    ckptr = ocp.StandardCheckpointer()
    try:
        tree = saved_tree(path, ckptr)
        saved = _flatten(tree)
        if any(weight_of(name) for name in saved):  # saved int8-quantized: keep it so
            head_scale = scale_key(head_key(expected))
            wq = WeightQuant(lm_head=head_scale in saved)
            expected = quant_param_shapes(expected, wq)
        want = _flatten(expected)
        if set(saved) != set(want):
            missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
            raise CheckpointError(
                f"{path}: params do not match the model config (missing: {missing}, extra: {extra})"
            )
        for name, shape in want.items():
            if tuple(saved[name].shape) != shape:
                raise CheckpointError(
                    f"{path}: param {name!r} has shape {tuple(saved[name].shape)}, expected {shape}"
                )
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding), dict(tree)
        )
        restored = ckptr.restore(path, abstract)
    finally:
        ckptr.close()
    return cast_floats(restored, target)
