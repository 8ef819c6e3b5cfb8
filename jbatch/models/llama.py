"""Llama / Mistral / Qwen2 decoder over a paged KV pool, as pure functions of a params pytree.

Why pure functions over a dict of arrays instead of Flax modules: the engine jit-compiles a few
pure functions that *donate* the whole engine state (KV pool included) and update it by scatter;
a params dict is exactly what the safetensors loader produces, what orbax saves, and what a
``NamedSharding`` tree annotates for tensor parallelism — no module state, no ``apply`` plumbing,
and the per-layer weights are stacked on a leading axis (ready for ``lax.scan`` or pipelining).
The layer loop is unrolled so every layer's K/V scatter updates the donated pool in place.

The forward pass takes a **flat batch of tokens** laid out as

    [ num_decode rows | num_prefill_blocks x block_q rows ]

Decode rows are single tokens of any sequences; prefill rows are prompt chunks cut into blocks of
``block_q`` tokens of one sequence each (padding: position -1). Each token carries its slot id and
absolute position; its K/V is scattered into the pool at ``page_tables[slot, pos // S]`` before
attention, which then reads every sequence through its page table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jbatch.models import moe
from jbatch.models.config import ModelConfig, rope_inv_freq
from jbatch.models.kv_cache import KVCache, write_layer, write_locations
from jbatch.models.moe_config import MLP_GROUPS, group_of_layer
from pallas_kernels import PALLAS_IMPLS, paged_attention, paged_attention_rows, resolve_impl

Params = dict


def rms_norm(x: Float[Array, "t e"], w: Float[Array, " e"], eps: float) -> Float[Array, "t e"]:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def rope_tables(
    cfg: ModelConfig, positions: Int[Array, " t"]
) -> tuple[Float[Array, "t half"], Float[Array, "t half"]]:
    inv_freq = jnp.asarray(np.asarray(rope_inv_freq(cfg), np.float32))  # [D/2]
    angles = jnp.maximum(positions, 0).astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "t h d"], cos: Float[Array, "t half"], sin: Float[Array, "t half"]
) -> Float[Array, "t h d"]:
    """Rotate-half RoPE (the HF Llama convention: first and second halves of each head)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _linear(x, layer: Params, w: str, b: str):
    y = x @ layer[w]
    return y + layer[b] if b in layer else y


def layer_params(layers: Params | tuple[Params, ...], i: int) -> Params:
    """Layer ``i``'s weights, from stacked ``{name: [L, ...]}`` or per-layer ``({name: ...},)``."""
    if isinstance(layers, (tuple, list)):
        return layers[i]
    return {name: w[i] for name, w in layers.items()}


def unstack_layers(params: Params) -> Params:
    """The same params with ``layers`` as a tuple of per-layer dicts (call once, outside jit).

    The checkpoint layout stacks each weight over layers (``[L, ...]``), but inside a jitted
    step XLA CPU copies every ``w[i]`` slice before its matmul — a full pass over the weights per
    step. Separate per-layer arrays are read in place (same reason the KV pool is per layer)."""
    out = dict(params)
    for group in ("layers", *MLP_GROUPS):  # MoE models: also their MLP groups
        stacked = params.get(group)
        if stacked is None or isinstance(stacked, (tuple, list)):
            continue
        n = len(next(iter(stacked.values())))
        out[group] = tuple(layer_params(stacked, i) for i in range(n))
    return out


def _layer(params: Params, cfg: ModelConfig, i: int) -> Params:
    """Layer ``i``'s weights; a MoE model's MLP weights come from their own group."""
    lp = layer_params(params["layers"], i)
    group = group_of_layer(cfg, i)
    return lp if group is None else {**lp, **layer_params(params[group[0]], group[1])}


def _attention(
    q: Float[Array, "t h d"],
    cache: KVCache,
    layer: int,
    slots: Int[Array, " t"],
    positions: Int[Array, " t"],
    page_tables: Int[Array, "slots mp"],
    num_decode: int,
    block_q: int,
    sliding_window: int | None,
    impl: str,
) -> Float[Array, "t h d"]:
    t, h, d = q.shape
    kp, vp = cache.k[layer], cache.v[layer]  # [P, S, KVH, D] each
    impl = resolve_impl(impl, q, kp)
    if impl in PALLAS_IMPLS:
        # One ragged kernel call: every decode row and every prompt block is its own entry.
        num_blocks = (t - num_decode) // block_q
        row_entry = np.concatenate(
            [np.arange(num_decode), num_decode + np.repeat(np.arange(num_blocks), block_q)]
        ).astype(np.int32)  # [T] static
        entry_rows = np.concatenate(
            [np.arange(num_decode), num_decode + block_q * np.arange(num_blocks)]
        ).astype(np.int32)  # [E] first row of each entry (static)
        entry_slots = jnp.clip(slots[entry_rows], 0, page_tables.shape[0] - 1)  # [E]
        return paged_attention_rows(
            q,
            kp,
            vp,
            jnp.asarray(row_entry),
            page_tables[entry_slots],
            positions,
            sliding_window=sliding_window,
            max_query_len=block_q if num_blocks else 1,
            interpret=impl == "pallas_interpret",
        )
    outs = []
    if num_decode:
        o = paged_attention(
            q[:num_decode, None],  # [Nd, 1, H, D]
            kp,
            vp,
            page_tables[jnp.clip(slots[:num_decode], 0, page_tables.shape[0] - 1)],
            positions[:num_decode, None],
            sliding_window=sliding_window,
            impl=impl,
        )
        outs.append(o.reshape(num_decode, h, d))
    num_prefill = t - num_decode
    if num_prefill:
        nb = num_prefill // block_q
        block_slots = jnp.clip(slots[num_decode::block_q], 0, page_tables.shape[0] - 1)  # [NB]
        o = paged_attention(
            q[num_decode:].reshape(nb, block_q, h, d),
            kp,
            vp,
            page_tables[block_slots],
            positions[num_decode:].reshape(nb, block_q),
            sliding_window=sliding_window,
            impl=impl,
        )
        outs.append(o.reshape(num_prefill, h, d))
    return jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def forward(
    params: Params,
    cfg: ModelConfig,
    cache: KVCache,
    tokens: Int[Array, " t"],
    positions: Int[Array, " t"],
    slots: Int[Array, " t"],
    page_tables: Int[Array, "slots max_pages"],
    *,
    num_decode: int,
    block_q: int = 1,
    attn_impl: str = "auto",
    attention=None,
    experts=None,
) -> tuple[Float[Array, "t e"], KVCache]:
    """Run the decoder over a flat token batch; returns final-norm hidden states and the pool.

    ``attention`` replaces the per-layer attention call (same arguments as ``_attention``);
    tensor parallelism passes a ``shard_map`` of it (``jbatch.parallel.attention``), and
    likewise ``experts`` for :func:`jbatch.models.moe.expert_outputs`."""
    attend = _attention if attention is None else attention
    t = tokens.shape[0]
    if num_decode > t or (t - num_decode) % block_q:
        raise ValueError(
            f"token batch of {t} rows does not split into {num_decode} decode rows plus "
            f"blocks of block_q={block_q}"
        )
    h_, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = params["embed"][jnp.clip(tokens, 0, cfg.vocab_size - 1)]  # [T, E]
    cos, sin = rope_tables(cfg, positions)
    pages, offsets = write_locations(
        page_tables, slots, positions, cache.page_size, cache.num_pages
    )
    for i in range(cfg.num_layers):
        lp = _layer(params, cfg, i)
        xn = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q = _linear(xn, lp, "wq", "bq").reshape(t, h_, d)
        k = _linear(xn, lp, "wk", "bk").reshape(t, kvh, d)
        v = _linear(xn, lp, "wv", "bv").reshape(t, kvh, d)
        if cfg.qk_norm:
            q, k = (
                rms_norm(q, lp["q_norm"], cfg.rms_norm_eps),
                rms_norm(k, lp["k_norm"], cfg.rms_norm_eps),
            )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = write_layer(cache, i, k, v, pages, offsets)
        attn = attend(
            q,
            cache,
            i,
            slots,
            positions,
            page_tables,
            num_decode,
            block_q,
            cfg.sliding_windows[i],
            attn_impl,
        )
        x = x + _linear(attn.reshape(t, h_ * d), lp, "wo", "bo")
        xn = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        if cfg.moe_layers[i]:  # routed experts (jbatch.models.moe)
            x = x + moe.sparse_mlp(lp, cfg, xn, positions >= 0, experts)
        else:
            gate = _linear(xn, lp, "w_gate", "b_gate")
            up = _linear(xn, lp, "w_up", "b_up")
            x = x + _linear(jax.nn.silu(gate) * up, lp, "w_down", "b_down")
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cache


def compute_logits(params: Params, hidden: Float[Array, "n e"]) -> Float[Array, "n vocab"]:
    """LM head (tied to the embedding when the checkpoint has no ``lm_head``), in float32."""
    head = params.get("lm_head", params["embed"])  # [V, E]: rows stream contiguously
    return (hidden @ head.T).astype(jnp.float32)
