"""8-bit KV storage: one scale per (token, KV head), quantize on write, dequantize on read.

A quantized layer pool is ``data [P, S, KVH, D]`` in int8 or float8_e4m3fn plus
``scales [P, S, KVH]`` in bfloat16; entry ``(p, s, h)`` holds the vector
``data[p, s, h] * scales[p, s, h]``. Why this granularity (see docs/architecture.md, "KV cache
quantization"):

* **Per token and head**: the engine writes K/V one token row at a time (decode) or a chunk at
  a time; a token's scale depends only on its own row, so a write never re-quantizes rows
  already in the page (a per-page scale would have to grow, and re-round, as tokens arrive).
* **bfloat16 scales**: 2 bytes per row instead of 4 (at head dim 64: 66 vs 68 bytes per row,
  1.94x vs 1.88x the tokens of a bfloat16 pool). The scale is rounded to bfloat16 *first* and
  the row is quantized with that rounded scale, so the stored scale is exactly the one used;
  it is rounded up (inflated by one bfloat16 ulp before rounding) so ``|x| / scale`` never
  exceeds the format's maximum. bfloat16 keeps float32's exponent range: no scale under- or
  overflows.

The contract every attention path keeps: an 8-bit pool reads exactly like a pool of the query's
dtype holding :func:`dequantize` of its entries (NaN scales in unused pages read as NaN, which
the paths mask like any other unwritten entry).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

# EngineConfig.kv_cache_dtype name -> storage dtype
KV_STORAGE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn)}
SCALE_DTYPE = jnp.dtype(jnp.bfloat16)
_SCALE_ULP = 2.0**-7  # bfloat16's relative spacing (8 significant bits)


def is_quantized(dtype) -> bool:
    """Whether ``dtype`` is an 8-bit storage dtype (a pool of it carries scales)."""
    return jnp.dtype(dtype) in KV_STORAGE_DTYPES.values()


def qmax(dtype) -> float:
    """The largest magnitude a quantized entry holds: 127 (int8), 448 (float8_e4m3fn)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return 127.0
    return float(jnp.finfo(dtype).max)


def quantize(
    x: Float[Array, "*rows d"], dtype
) -> tuple[Shaped[Array, "*rows d"], Float[Array, " *rows"]]:
    """Each row (last axis) of ``x`` as ``dtype`` entries times one bfloat16 scale."""
    dtype = jnp.dtype(dtype)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    # Round the scale up to bfloat16, then quantize with exactly that stored scale.
    scale = (amax / qmax(dtype) * (1.0 + _SCALE_ULP)).astype(SCALE_DTYPE)
    s32 = scale.astype(jnp.float32)
    inv = jnp.where(s32 > 0, 1.0 / jnp.where(s32 > 0, s32, 1.0), 0.0)  # all-zero rows stay 0
    y = jnp.clip(x32 * inv[..., None], -qmax(dtype), qmax(dtype))
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(
    data: Shaped[Array, "*rows d"], scales: Float[Array, " *rows"], dtype=jnp.float32
) -> Float[Array, "*rows d"]:
    """``data * scales`` (one scale per row) as ``dtype``."""
    out = data.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]
    return out.astype(dtype)


def check_scales(k_pages, v_pages, k_scales, v_scales) -> None:
    """ValueError unless the pool is float with no scales, or 8-bit (one dtype for K and V)
    with bfloat16 ``[P, S, KVH]`` scales for both."""
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k/v pages dtypes must match; got {k_pages.dtype}, {v_pages.dtype}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (an 8-bit pool)")
    if is_quantized(k_pages.dtype) != (k_scales is not None):
        raise ValueError(
            f"a {k_pages.dtype} pool needs scales exactly when it is 8-bit; got "
            f"k_scales={'None' if k_scales is None else 'given'}"
        )
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if s is not None and (s.shape != k_pages.shape[:3] or s.dtype != SCALE_DTYPE):
            raise ValueError(
                f"{name} must be {SCALE_DTYPE} {k_pages.shape[:3]} (pages, S, KVH); "
                f"got {s.dtype} {s.shape}"
            )


def storage_dtype(kv_cache_dtype: str, model_dtype: str) -> jnp.dtype:
    """The pool's dtype for an ``EngineConfig.kv_cache_dtype`` ("auto": the model dtype)."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in KV_STORAGE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {('auto', *KV_STORAGE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return KV_STORAGE_DTYPES[kv_cache_dtype]


def check_backend(kv_cache_dtype: str) -> None:
    """Raise ValueError naming ``kv_cache_dtype`` if the default backend cannot store and convert
    it (compiles one tiny program; a no-op for "auto")."""
    dtype = storage_dtype(kv_cache_dtype, "float32")
    if not is_quantized(dtype):
        return
    try:
        x = jnp.linspace(-2.0, 2.0, 8, dtype=jnp.float32).reshape(2, 4)
        data, scale = jax.jit(quantize, static_argnums=1)(x, dtype)
        back = jax.device_get(dequantize(data, scale))
    except Exception as e:  # any backend failure means "not supported"
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported on the "
            f"{jax.default_backend()} backend: {e}"
        ) from e
    if not abs(back - jax.device_get(x)).max() < 0.25:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} does not round-trip on the "
            f"{jax.default_backend()} backend"
        )
