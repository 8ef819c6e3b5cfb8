"""Rotary position embeddings: the per-layer RoPE settings of a checkpoint, their frequencies,
and the rotation itself.

One :class:`Rope` describes how one layer rotates q and k: base, scaling type and its
parameters, how many of the head's dimensions rotate (``partial_rotary_factor``), and the
factor applied to cos/sin (YaRN's and LongRoPE's attention factor). A model has one per layer
(Gemma 3's local layers use a different base and no scaling), so ``ModelConfig.ropes`` is a
tuple and the forward pass computes one cos/sin table per *distinct* Rope.

Frequencies are computed on the host exactly as HF transformers computes them (float64 math,
then float32), so positions rotate bit-for-bit alike. Sequence-length-dependent types:

* ``dynamic`` (NTK): HF changes the base only once a sequence grows past
  ``max_position_embeddings``; jbatch never serves a sequence that long (``max_seq_len`` is
  capped by it), so within every length jbatch serves, dynamic equals the unscaled rotation.
* ``longrope``: HF uses the short factors while the *whole batch's* longest sequence fits in
  ``original_max_position_embeddings`` and the long factors for every token once it does not.
  A batch-wide switch would make one request's output depend on its neighbours, and a cached
  key's rotation depend on when it was written. jbatch picks per token: a position below
  ``original_max_position_embeddings`` rotates with the short factors, one at or past it with
  the long factors. Identical to HF for sequences that fit the original window (the common
  case); past it, keys written earlier keep their short-factor rotation (as HF's own KV cache
  does when a generation crosses the boundary).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class RopeError(ValueError):
    """RoPE settings jbatch cannot apply; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding (hashable: it keys the per-step cos/sin tables)."""

    theta: float = 10000.0
    rope_type: str = "default"
    rotary_dim: int = 0  # dimensions of a head that rotate (the first ones); 0 = all
    factor: float = 1.0
    attention_factor: float = 1.0  # multiplies cos and sin (YaRN, LongRoPE)
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # longrope (one factor per rotated frequency)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            supported = ", ".join(ROPE_TYPES)
            raise RopeError(f"rope type {self.rope_type!r} is not supported ({supported})")
        if self.factor <= 0:
            raise RopeError(f"rope factor must be > 0, got {self.factor}")
        if self.rotary_dim % 2:
            raise RopeError(f"rotary dimension must be even, got {self.rotary_dim}")
        if self.rope_type == "longrope":
            half = self.rotary_dim // 2
            for name in ("short_factor", "long_factor"):
                if len(getattr(self, name)) != half:
                    raise RopeError(
                        f"longrope {name} has {len(getattr(self, name))} entries, expected "
                        f"rotary_dim/2={half}"
                    )


def parse_rope(params: dict[str, Any], hf: dict[str, Any], head_dim: int, source: str) -> Rope:
    """A :class:`Rope` from one HF rope dict (``rope_scaling``/``rope_parameters`` or one
    per-layer-type entry of it) and the top-level config ``hf`` for fields older configs keep
    there (``rope_theta``, ``partial_rotary_factor``, ``original_max_position_embeddings``)."""
    get = lambda key, default=None: params.get(key, hf.get(key, default))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise RopeError(
            f"{source}: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    rotary_dim = int(head_dim * float(get("partial_rotary_factor", 1.0)))
    rotary_dim -= rotary_dim % 2
    kw: dict[str, Any] = dict(
        theta=float(get("rope_theta", 10000.0)), rope_type=rope_type, rotary_dim=rotary_dim
    )
    max_pos = int(hf.get("max_position_embeddings", 4096))
    orig = get("original_max_position_embeddings")
    if rope_type in ("linear", "dynamic", "llama3", "yarn"):
        factor = params.get("factor")
        if factor is None and rope_type == "yarn" and orig:
            factor = max_pos / int(orig)
        if factor is None:
            raise RopeError(f"{source}: rope_scaling of type {rope_type!r} is missing 'factor'")
        kw["factor"] = float(factor)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise RopeError(f"{source}: rope_scaling of type 'llama3' is missing {key!r}")
            kw[key] = type(getattr(Rope, key))(params[key])
    if rope_type in ("yarn", "longrope"):
        if orig is None:
            if rope_type == "longrope":
                raise RopeError(f"{source}: longrope needs 'original_max_position_embeddings'")
            orig = max_pos
        kw["original_max_position_embeddings"] = int(orig)
    if rope_type == "yarn":
        kw.update(_yarn_settings(params, kw["factor"]))
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if key not in params:
                raise RopeError(f"{source}: rope_scaling of type 'longrope' is missing {key!r}")
            kw[key] = tuple(float(f) for f in params[key])
        factor = float(params.get("factor") or max_pos / kw["original_max_position_embeddings"])
        attn = params.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(int(orig)))
        kw["factor"], kw["attention_factor"] = factor, float(attn)
    return Rope(**kw)


def _yarn_settings(params: dict[str, Any], factor: float) -> dict[str, Any]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if attn is None:
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return dict(
        attention_factor=float(attn),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
    )


def inv_freq(rope: Rope, head_dim: int, long: bool = False) -> np.ndarray:
    """Inverse frequencies ``[rotary_dim / 2]`` (float32), as HF transformers computes them."""
    dim = rope.rotary_dim or head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    base = (rope.theta**exponents).astype(np.float32)
    inv = (1.0 / base).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv / rope.factor).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3(inv, rope)
    if rope.rope_type == "yarn":
        return _yarn(base, rope, dim)
    if rope.rope_type == "longrope":
        ext = np.asarray(rope.long_factor if long else rope.short_factor, np.float32)
        return (1.0 / (ext * base)).astype(np.float32)
    return inv  # default, dynamic (see the module docstring)


def _llama3(inv: np.ndarray, rope: Rope) -> np.ndarray:
    orig = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = orig / rope.low_freq_factor, orig / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (orig / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(base: np.ndarray, rope: Rope, dim: int) -> np.ndarray:
    orig = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extra = (1.0 / base).astype(np.float32)
    inv_inter = (1.0 / (rope.factor * base)).astype(np.float32)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def rope_tables(
    rope: Rope, head_dim: int, positions: Int[Array, " t"]
) -> tuple[Float[Array, "t half"], Float[Array, "t half"]]:
    """cos and sin of every position's angles (attention factor applied); padding rows (position
    -1) get position 0's."""
    pos = jnp.maximum(positions, 0).astype(jnp.float32)[:, None]
    angles = pos * jnp.asarray(inv_freq(rope, head_dim))[None, :]
    if rope.rope_type == "longrope":
        long_angles = pos * jnp.asarray(inv_freq(rope, head_dim, long=True))[None, :]
        past = (positions >= rope.original_max_position_embeddings)[:, None]
        angles = jnp.where(past, long_angles, angles)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos, sin


def apply_rope(
    x: Float[Array, "t h d"], cos: Float[Array, "t half"], sin: Float[Array, "t half"]
) -> Float[Array, "t h d"]:
    """Rotate-half RoPE (the HF Llama convention) on the first ``2 * half`` dimensions of each
    head; the rest (partial rotary) pass through.

    Computed as ``x * [c, c] + swap(x) * [-s, s]``, where ``swap`` exchanges the two halves (a
    reverse over a size-2 axis): the same products and sums as ``[x1 c - x2 s, x2 c + x1 s]``,
    bit for bit, but XLA:CPU fuses it into one elementwise loop, where the concatenation of two
    computed halves ran ~4x slower (~120 µs a layer at 32 rows of the 30-layer SmolLM2 shape)."""
    t, h, _ = x.shape
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half].astype(jnp.float32), x[..., 2 * half :]
    swapped = rot.reshape(t, h, 2, half)[:, :, ::-1, :].reshape(t, h, 2 * half)
    c = jnp.concatenate([cos, cos], axis=-1)[:, None, :]
    s = jnp.concatenate([-sin, sin], axis=-1)[:, None, :]
    out = (rot * c + swapped * s).astype(x.dtype)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
