"""Sizes the user left open, taken from the model and the machine (like vLLM's ``max_model_len``
and ``gpu_memory_utilization``).

* ``max_seq_len=None``: the model's ``max_position_embeddings``, capped by what the KV pool can
  hold (``num_pages * page_size`` tokens). Asking for more than the model's positions is an error.
* ``kv_cache_memory``: the pool's size as a memory budget instead of ``num_pages``: bytes
  (``"2GiB"``, ``"512MB"``, ``"1073741824"``) or a fraction of the device's free memory
  (``"0.8"``; accelerators only: the CPU backend reports no memory). Pages cost what the pool
  really stores per page: K and V of every layer in the KV dtype, plus their scales when the pool
  is 8-bit (``jbatch.models.kv_cache``), measured on the pool's abstract shape, not assumed.
* ``num_pages=None`` and no budget: 512 pages.

:func:`resolve` returns a copy of the config with every size concrete and logs what it chose;
``LLMEngine`` and ``LLM`` call it, so ``engine.cfg`` is always concrete (the budget, once
turned into ``num_pages``, is dropped from it). Resolving a concrete
config returns it unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import numpy as np

from jbatch.models.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_NUM_PAGES = 512
_UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_memory(text: str | int | float) -> tuple[int | None, float | None]:
    """``(bytes, None)`` for an amount, ``(None, fraction)`` for a share of free device memory;
    ValueError naming the value otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"kv_cache_memory must be an amount or a fraction, got {text!r}")
    s = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(
            f"kv_cache_memory={text!r} is not an amount (e.g. '2GiB', '512MB', bytes) or a "
            f"fraction of free device memory (e.g. '0.8')"
        )
    value, unit = float(m.group(1)), m.group(2)
    if not unit and "." in m.group(1):
        if not 0 < value <= 1:
            raise ValueError(f"kv_cache_memory={text!r}: a fraction must be in (0, 1]")
        return None, value
    amount = int(value * _UNITS[unit])
    if amount <= 0:
        raise ValueError(f"kv_cache_memory={text!r} must be > 0")
    return amount, None


def page_bytes(model_cfg: ModelConfig, page_size: int, kv_dtype, tpu_layout=False) -> int:
    """Bytes one page costs in the pool: every layer's K and V (and scales, for an 8-bit pool;
    head padding, in the TPU kernel's layout)."""
    from jbatch.models.kv_cache import KVCache

    full = lambda: KVCache.full(model_cfg, 1, page_size, kv_dtype, tpu_layout=tpu_layout)
    shape = jax.eval_shape(full)
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(shape))


def free_device_bytes() -> int:
    """Free memory of the first device, from its allocator's statistics."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(
            f"kv_cache_memory as a fraction needs the device's memory statistics, which the "
            f"{jax.default_backend()} backend does not report; give an amount (e.g. '2GiB')"
        )
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def resolve(cfg, model_cfg: ModelConfig):
    """``cfg`` (an ``EngineConfig``) with ``num_pages`` and ``max_seq_len`` concrete; ValueError
    naming the field when the model or the budget cannot give what was asked."""
    if cfg.is_resolved:
        _check_positions(cfg.max_seq_len, model_cfg)
        return cfg
    num_pages = cfg.num_pages
    if num_pages is None:
        num_pages = _pages_for_budget(cfg, model_cfg) if cfg.kv_cache_memory else DEFAULT_NUM_PAGES
    pool_tokens = num_pages * cfg.page_size
    max_seq_len = cfg.max_seq_len
    if max_seq_len is None:
        max_seq_len = min(model_cfg.max_position_embeddings, pool_tokens)
    _check_positions(max_seq_len, model_cfg)
    if pool_tokens < max_seq_len:
        raise ValueError(
            f"the KV pool ({num_pages} pages x page_size={cfg.page_size} = {pool_tokens} tokens"
            f"{f', from kv_cache_memory={cfg.kv_cache_memory!r}' if cfg.kv_cache_memory else ''})"
            f" cannot hold one sequence of max_seq_len={max_seq_len}"
        )
    # The budget is spent on num_pages: the resolved config is concrete sizes only.
    out = dataclasses.replace(
        cfg, num_pages=num_pages, max_seq_len=max_seq_len, kv_cache_memory=None
    )
    log.info(
        "engine sizes: %d slots, %d pages x %d tokens = %d tokens of KV (%s), max_seq_len=%d%s",
        cfg.max_slots, num_pages, cfg.page_size, pool_tokens,
        np.dtype(cfg.kv_storage_dtype).name, max_seq_len,
        "" if cfg.max_seq_len else " (from the model)",
    )  # fmt: skip
    return out


def _check_positions(max_seq_len: int, model_cfg: ModelConfig) -> None:
    if max_seq_len > model_cfg.max_position_embeddings:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds the model's "
            f"max_position_embeddings={model_cfg.max_position_embeddings}"
        )


def _pages_for_budget(cfg, model_cfg: ModelConfig) -> int:
    """Pages a ``kv_cache_memory`` budget (per device) holds; with ``tp`` each device holds its
    KV heads' share of every page (heads replicated when tp exceeds them)."""
    from jbatch.parallel.mesh import sharded_model_config

    amount, fraction = parse_memory(cfg.kv_cache_memory)
    if fraction is not None:
        amount = int(free_device_bytes() * fraction)
    per_page = page_bytes(
        sharded_model_config(model_cfg, cfg.tp), cfg.page_size, cfg.kv_storage_dtype,
        cfg.tpu_kv_layout,
    )  # fmt: skip
    pages = amount * cfg.tp // per_page
    if pages < 1:
        raise ValueError(
            f"kv_cache_memory={cfg.kv_cache_memory!r} ({amount} bytes) holds no page "
            f"(one page of {cfg.page_size} tokens costs {per_page // cfg.tp} bytes per device)"
        )
    return int(pages)
