"""Load Hugging Face safetensors checkpoints into jbatch's params pytree; orbax save/restore.

Layout (L layers stacked on a leading axis; HF ``[out, in]`` linear weights transposed to
``[in, out]``) is given by :func:`expected_param_shapes`.
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
from jbatch.moe_checkpoint import iter_groups, moe_param_shapes

Params = dict[str, Any]  # nested dict of Float[Array, "..."]
HostArray = Float[np.ndarray, "..."]

SUPPORTED_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
# safetensors dtype tags we accept as weights; BF16 is read from raw bytes (numpy lacks it).
_FLOAT_TAGS = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint jbatch cannot load; the message names the file (and tensor) at fault."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one jbatch param comes from: an HF tensor name (under ``model.layers.{i}.`` for
    layer params), whether it is a linear weight (HF ``[out, in]``, transposed on load), and for
    a fused tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``) the slice of its output rows."""

    name: str
    linear: bool = False
    rows: tuple[int, int] | None = None  # [start, stop) of the fused tensor's out rows
    fused_out: int = 0  # out rows of the whole fused tensor

    def hf_shape(self, jb_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The file's shape of the tensor behind a param of (per-layer) shape ``jb_shape``."""
        shape = jb_shape[::-1] if self.linear else jb_shape
        return (self.fused_out, *shape[1:]) if self.rows else shape

    def take(self, tensor):
        """The param's part of the file's tensor (a view for a fused one), in HF layout."""
        return tensor[self.rows[0] : self.rows[1]] if self.rows else tensor


# jbatch layer param -> its HF tensor, for the Llama layout every family starts from.
_LAYER_TENSORS = {
    "attn_norm": Source("input_layernorm.weight"),
    "wq": Source("self_attn.q_proj.weight", True),
    "wk": Source("self_attn.k_proj.weight", True),
    "wv": Source("self_attn.v_proj.weight", True),
    "wo": Source("self_attn.o_proj.weight", True),
    "bq": Source("self_attn.q_proj.bias"),
    "bk": Source("self_attn.k_proj.bias"),
    "bv": Source("self_attn.v_proj.bias"),
    "bo": Source("self_attn.o_proj.bias"),
    "q_norm": Source("self_attn.q_norm.weight"),
    "k_norm": Source("self_attn.k_norm.weight"),
    "mlp_norm": Source("post_attention_layernorm.weight"),
    "w_gate": Source("mlp.gate_proj.weight", True),
    "w_up": Source("mlp.up_proj.weight", True),
    "w_down": Source("mlp.down_proj.weight", True),
    "b_gate": Source("mlp.gate_proj.bias"),
    "b_up": Source("mlp.up_proj.bias"),
    "b_down": Source("mlp.down_proj.bias"),
}
# Gemma 2/3 normalise four times a layer; their `post_attention_layernorm` is the norm of the
# attention *output*, and the pre-MLP norm is `pre_feedforward_layernorm`.
_SANDWICH_NORMS = {
    "post_attn_norm": Source("post_attention_layernorm.weight"),
    "mlp_norm": Source("pre_feedforward_layernorm.weight"),
    "post_mlp_norm": Source("post_feedforward_layernorm.weight"),
}
# jbatch top-level param -> its HF tensor name after the model prefix (see `weight_prefix`).
_TOP_TENSORS = {
    "embed": Source("embed_tokens.weight"),
    "final_norm": Source("norm.weight"),
    "lm_head": Source("lm_head.weight"),  # kept [V, E], like the embedding (faster LM head)
}
# Where the decoder's tensors live: causal LMs under `model.`; Gemma 3 multimodal folders keep
# the language model under `model.language_model.` (transformers 5) or `language_model.model.`.
_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def layer_sources(cfg: ModelConfig) -> dict[str, Source]:
    """The HF tensor of every layer param of ``cfg``'s family."""
    sources = dict(_LAYER_TENSORS)
    if cfg.sandwich_norms:
        sources.update(_SANDWICH_NORMS)
    if cfg.model_type == "phi3":  # fused projections, split on load
        q, kv, f = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.intermediate_size,
        )
        qkv = lambda lo, hi: Source("self_attn.qkv_proj.weight", True, (lo, hi), q + 2 * kv)
        gate_up = lambda lo, hi: Source("mlp.gate_up_proj.weight", True, (lo, hi), 2 * f)
        sources.update(
            wq=qkv(0, q), wk=qkv(q, q + kv), wv=qkv(q + kv, q + 2 * kv),
            w_gate=gate_up(0, f), w_up=gate_up(f, 2 * f),
        )  # fmt: skip
    return sources


def weight_prefix(names, where: str) -> str:
    """The prefix of the decoder's tensors among tensor ``names`` (see ``_PREFIXES``)."""
    for prefix in _PREFIXES:
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise CheckpointError(
        f"{where}: no embedding tensor found (looked for "
        f"{', '.join(p + 'embed_tokens.weight' for p in _PREFIXES)})"
    )


def top_name(key: str, prefix: str) -> str:
    """The HF name of top-level param ``key`` (the LM head sits outside the model prefix)."""
    return _TOP_TENSORS[key].name if key == "lm_head" else prefix + _TOP_TENSORS[key].name


_MLP_KEYS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def expected_param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of every param (same nesting as the params pytree), as tuples of ints."""
    L, E, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Q, KV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (L, E),
        "wq": (L, E, Q),
        "wk": (L, E, KV),
        "wv": (L, E, KV),
        "wo": (L, Q, E),
        "mlp_norm": (L, E),
        "w_gate": (L, E, F),
        "w_up": (L, E, F),
        "w_down": (L, F, E),
    }
    if cfg.has_qkv_bias:
        layers.update(bq=(L, Q), bk=(L, KV), bv=(L, KV))
    if cfg.attention_bias:
        layers["bo"] = (L, E)
    if cfg.mlp_bias:
        layers.update(b_gate=(L, F), b_up=(L, F), b_down=(L, E))
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    if cfg.sandwich_norms:
        layers.update(post_attn_norm=(L, E), post_mlp_norm=(L, E))
    groups = moe_param_shapes(cfg)  # MoE: the MLP weights live in their own groups
    if groups:
        layers = {k: v for k, v in layers.items() if k not in _MLP_KEYS}
    shapes: dict[str, Any] = {"embed": (V, E), "layers": layers, "final_norm": (E,), **groups}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, E)
    return shapes


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
        try:
            meta = ckptr.metadata(path)
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable orbax checkpoint ({e})") from e
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        if not isinstance(tree, dict):
            raise CheckpointError(f"{path}: not an orbax params checkpoint (no tree metadata)")
        saved = _flatten(dict(tree))
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
