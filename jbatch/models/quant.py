"""Weight-only int8 quantization: per-output-channel symmetric scales, dequantized in the matmul.

A quantized weight keeps its params key and layout (``wq``: ``[L, in, out]`` int8) and gains a
float32 scale under ``<key>_scale`` with the contraction axis removed (``wq_scale``: ``[L, out]``);
``w ~= q * scale`` column by column. Leading axes (stacked layers, experts) are carried through.
The LM head (``lm_head``, or the tied ``embed``) is ``[V, E]``: it contracts its last axis, so its
scale is one per vocabulary row ``[V]`` (which also dequantizes embedding lookups of a tied head).

The params tree stays a plain dict of arrays: the loaders, orbax, ``NamedSharding`` trees and
``layer_params`` need nothing new beyond the extra ``*_scale`` keys.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Int8

QUANT_MODES = ("int8",)
# Every linear layer weight of a decoder layer (contraction axis -2, output axis -1). A new
# linear weight (MoE experts...) is quantized once it is listed here.
QUANTIZED_LAYER_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
LM_HEAD_WEIGHTS = ("lm_head", "embed")  # [V, E]: contraction axis -1 (``embed`` when tied)
SCALE_SUFFIX = "_scale"
_QMAX = 127.0


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """Which weights are quantized and how (``EngineConfig.weight_quant``)."""

    mode: str = "int8"
    lm_head: bool = False  # also the LM head (the embedding too when tied to it)

    def __post_init__(self):
        if self.mode not in QUANT_MODES:
            raise ValueError(f"quantization must be one of {QUANT_MODES}, got {self.mode!r}")

    def layer_key(self, key: str) -> bool:
        """Is layer param ``key`` quantized?"""
        return key in QUANTIZED_LAYER_WEIGHTS

    def top_keys(self, tree: dict) -> tuple[str, ...]:
        """Top-level params quantized in ``tree`` (params or their shapes): the LM head."""
        return (head_key(tree),) if self.lm_head else ()


def head_key(tree: dict) -> str:
    """The LM head's param: ``lm_head``, or ``embed`` when the embeddings are tied to it."""
    return "lm_head" if "lm_head" in tree else "embed"


def scale_key(key: str) -> str:
    return key + SCALE_SUFFIX


def weight_of(key: str) -> str | None:
    """The weight a ``*_scale`` key scales, else None."""
    return key[: -len(SCALE_SUFFIX)] if key.endswith(SCALE_SUFFIX) else None


def contraction_axis(key: str) -> int:
    """Axis of weight ``key`` that the matmul contracts (and the scale reduces over)."""
    return -1 if key in LM_HEAD_WEIGHTS else -2


def scale_axis(weight_axis: int | None, weight_ndim: int, key: str) -> int | None:
    """The scale's axis matching ``weight_axis`` of weight ``key`` (sharding rules): None where
    the weight axis is the contraction axis (the scale has no such axis)."""
    if weight_axis is None:
        return None
    contract = contraction_axis(key) % weight_ndim
    if weight_axis == contract:
        return None
    return weight_axis if weight_axis < contract else weight_axis - 1


def quantize(
    w: Float[Any, "*shape"], axis: int = -2
) -> tuple[Int8[Any, "*shape"], Float[Any, "*shape"]]:
    """Symmetric int8 over ``axis``: ``(q, scale)`` with ``w ~= q * expand_dims(scale, axis)``,
    ``|q| <= 127`` and ``scale`` float32 (``axis`` removed). Numpy in, numpy out (the loaders
    quantize on the host); jax in, jax out. An all-zero channel gets scale 1 (q = 0)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w32 = w.astype(xp.float32)
    amax = xp.max(xp.abs(w32), axis=axis)
    scale = xp.where(amax > 0, amax / _QMAX, 1.0).astype(xp.float32)
    q = xp.round(w32 / xp.expand_dims(scale, axis))
    return xp.clip(q, -_QMAX, _QMAX).astype(xp.int8), scale


def dequantize(
    q: Int8[Any, "*shape"], scale: Float[Any, "*shape"], axis: int = -2, dtype=jnp.float32
) -> Float[Any, "*shape"]:
    xp = np if isinstance(q, np.ndarray) else jnp
    return (q.astype(xp.float32) * xp.expand_dims(scale, axis)).astype(dtype)


def matmul(
    x: Float[Array, "t k"], w: Float[Array, "k n"], scale: Float[Array, " n"] | None = None
) -> Float[Array, "t n"]:
    """``x @ w``; an int8 ``w`` is converted to ``x``'s dtype inside the matmul (accumulated in
    float32) and each output column multiplied by its scale."""
    if scale is None:
        return x @ w
    y = jax.lax.dot_general(
        x, w.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return (y * scale).astype(x.dtype)


def matmul_t(
    x: Float[Array, "t k"], w: Float[Array, "n k"], scale: Float[Array, " n"] | None = None
) -> Float[Array, "t n"]:
    """``x @ w.T`` (the LM head's ``[V, E]`` layout), dequantized like :func:`matmul`."""
    if scale is None:
        return x @ w.T
    y = jax.lax.dot_general(
        x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    return (y * scale).astype(x.dtype)


def embed_rows(params: dict, ids: Int[Array, " t"]) -> Float[Array, "t e"]:
    """Embedding rows ``ids``; an int8 (tied, quantized) embedding is dequantized per row into
    the dtype of the other float params."""
    rows = params["embed"][ids]
    scale = params.get(scale_key("embed"))
    if scale is None:
        return rows
    dtype = params["final_norm"].dtype
    return (rows.astype(jnp.float32) * scale[ids][:, None]).astype(dtype)


def param_shapes(shapes: dict, wq: WeightQuant) -> dict:
    """``expected_param_shapes`` of the float model, plus the ``*_scale`` shapes of ``wq``."""
    layers = dict(shapes["layers"])
    for key, shape in shapes["layers"].items():
        if wq.layer_key(key):
            layers[scale_key(key)] = _drop(shape, contraction_axis(key))
    out = {**shapes, "layers": layers}
    for key in wq.top_keys(shapes):
        out[scale_key(key)] = _drop(shapes[key], contraction_axis(key))
    return out


def _drop(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    axis %= len(shape)
    return shape[:axis] + shape[axis + 1 :]


class HostStack:
    """Host buffer of one stacked param ``key`` ``[L, ...]``, filled a layer at a time by a
    loader; a quantized key stores each layer as int8 as it arrives (peak host memory: the int8
    stack plus one float layer). :meth:`arrays` returns ``{key: ..., key_scale: ...}``."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype, wq: WeightQuant | None):
        self.key, self.quantized = key, wq is not None and wq.layer_key(key)
        self.values = np.empty(shape, np.int8 if self.quantized else dtype)
        axis = contraction_axis(key)
        self.scales = np.empty(_drop(shape, axis), np.float32) if self.quantized else None

    def __setitem__(self, i: int, w: Float[np.ndarray, "*shape"]) -> None:
        if self.quantized:
            self.values[i], self.scales[i] = quantize(np.asarray(w), contraction_axis(self.key))
        else:
            self.values[i] = w

    def arrays(self) -> dict[str, Any]:
        out = {self.key: jnp.asarray(self.values)}
        if self.quantized:
            out[scale_key(self.key)] = jnp.asarray(self.scales)
        return out


def quantize_top(
    key: str, w: Float[np.ndarray, "*shape"], dtype, wq: WeightQuant | None, tree: dict
):
    """``{key: w}`` as jax arrays in ``dtype``; int8 plus ``key_scale`` if ``wq`` quantizes
    top-level ``key`` of ``tree`` (the params' shapes)."""
    if wq is None or key not in wq.top_keys(tree):
        return {key: jnp.asarray(w.astype(dtype))}
    q, s = quantize(np.asarray(w), contraction_axis(key))
    return {key: jnp.asarray(q), scale_key(key): jnp.asarray(s)}


def quantize_params(params: dict, wq: WeightQuant) -> dict:
    """Quantize an in-memory float params tree (stacked or per-layer ``layers``). The loaders
    quantize while reading instead; this serves params that are already in memory."""

    def layer(lp: dict) -> dict:
        out = {}
        for key, w in lp.items():
            if wq.layer_key(key):
                out[key], out[scale_key(key)] = quantize(w, contraction_axis(key))
            else:
                out[key] = w
        return out

    layers = params["layers"]
    layers = tuple(map(layer, layers)) if isinstance(layers, (tuple, list)) else layer(layers)
    out = {**params, "layers": layers}
    for key in wq.top_keys(params):
        out[key], out[scale_key(key)] = quantize(params[key], contraction_axis(key))
    return out


def ensure_quantized(params: dict, wq: WeightQuant | None) -> dict:
    """``params`` quantized by ``wq`` unless ``wq`` is None or they already carry scales."""
    layers = params["layers"]
    first = layers[0] if isinstance(layers, (tuple, list)) else layers
    if wq is None or any(weight_of(k) for k in (*params, *first)):
        return params
    return quantize_params(params, wq)


def check_checkpoint(config_json: str | Path, wq: WeightQuant | None, num_experts: int = 0) -> None:
    """Raise ValueError (before any weight is read) if ``wq`` cannot apply to the checkpoint of
    this ``config.json``: weights already quantized by some other scheme are not re-quantized,
    and mixture-of-experts weights have no int8 path yet."""
    if wq is None:
        return
    if num_experts:
        raise ValueError(
            f"quantization={wq.mode!r} is not supported for mixture-of-experts models yet "
            f"(this one has {num_experts} experts); run it unquantized"
        )
    pre = json.loads(Path(config_json).read_text()).get("quantization_config")
    if pre:
        method = pre.get("quant_method") if isinstance(pre, dict) else pre
        raise ValueError(
            f"quantization={wq.mode!r}: the checkpoint is already quantized "
            f"(quantization_config.quant_method={method!r}); load its float weights instead"
        )


def cast_floats(params: dict, dtype) -> dict:
    """Cast every float param to ``dtype``; int8 weights and their float32 scales are kept."""

    def cast(path, a):
        name = str(getattr(path[-1], "key", path[-1]))
        if jnp.dtype(a.dtype) == jnp.int8 or weight_of(name) is not None:
            return a
        return jnp.asarray(a, dtype=dtype)

    return jax.tree_util.tree_map_with_path(cast, params)
