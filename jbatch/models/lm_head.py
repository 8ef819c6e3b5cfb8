"""The LM head on XLA:CPU: an ``[E, V]`` copy beside the ``[V, E]`` param.

The params keep the LM head (or the tied embedding) ``[V, E]``: the embedding lookup reads its
rows, and on accelerators either layout makes the same dot. XLA:CPU's YNNPACK dots do not: a
few rows against ``[V, E]`` (contracting each row's last axis) run ~2x slower than against
``[E, V]`` (measured, hidden 192, vocab 2 048: 5 rows 80 vs 45 µs; 1 row about equal; on the
30-layer SmolLM2-135M shape, 32 rows 1.11x). A speculative step's ``K + 1`` rows per request
and the small decode buckets are such dots. So a one-device CPU engine keeps an ``[E, V]`` copy
under ``HEAD_T`` (int8 heads with their scales, now per output column), which
:func:`jbatch.models.llama.compute_logits` uses when present — when it costs at most
``COPY_MAX_BYTES`` of RAM.
"""

from __future__ import annotations

import jax

from jbatch.models import quant

HEAD_T = "lm_head_t"
COPY_MAX_BYTES = 256 << 20


def with_cpu_head(params: dict) -> dict:
    """``params`` plus the ``[E, V]`` head copy (module doc) on a CPU device, else unchanged."""
    key = quant.head_key(params)
    head = params[key]
    if HEAD_T in params or jax.devices()[0].platform != "cpu":  # the one device's platform
        return params
    if head.nbytes > COPY_MAX_BYTES:
        return params
    out = {**params, HEAD_T: head.T}  # a new buffer, row-major [E, V]
    scale = params.get(quant.scale_key(key))
    if scale is not None:
        out[quant.scale_key(HEAD_T)] = scale
    return out
