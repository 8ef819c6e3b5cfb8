"""The decoder of every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) over a
paged KV pool, as pure functions of a params pytree.

One forward with a few switches from :class:`ModelConfig` rather than a module per family: the
families differ in a handful of places (norm style, extra norms, q/k norm, activation, logit
caps, per-layer RoPE and window), and one loop keeps the paged-attention plumbing, the KV
scatter and the tensor-parallel hooks in one place. A family's switches are set only by
``ModelConfig.from_hf_dict``; the weights' names only by ``jbatch.checkpoint``.

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

``packed_rows``: the prompt region's padding is left out of everything but attention. The
region's valid rows are gathered to the front of ``packed_rows`` rows (:class:`Packing`); the
embedding, projections, MLPs and the K/V scatter run on those, and only attention sees the
blocks (its queries gathered into them, its output gathered back). The hidden states come
back in the block layout, so the caller reads rows where it always did.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jbatch.models import moe, quant
from jbatch.models.config import ModelConfig
from jbatch.models.kv_cache import KVCache, write_layer, write_locations
from jbatch.models.lm_head import HEAD_T
from jbatch.models.moe_config import MLP_GROUPS, group_of_layer
from jbatch.models.rope import Rope, apply_rope, rope_tables
from pallas_kernels import PALLAS_IMPLS, paged_attention, paged_attention_rows, resolve_impl
from pallas_kernels.tpu_attention import tpu_paged_attention_rows

Params = dict


def rms_norm(
    x: Float[Array, "t e"], w: Float[Array, " e"], eps: float, offset: float = 0.0
) -> Float[Array, "t e"]:
    """RMSNorm. ``offset=0``: Llama's ``w * norm(x)`` (cast before the scale); otherwise
    Gemma's ``norm(x) * (offset + w)`` in float32, cast after."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (x32 * (offset + w.astype(jnp.float32))).astype(x.dtype)
    return w * x32.astype(x.dtype)


def _norm(cfg: ModelConfig, x, w):
    return rms_norm(x, w, cfg.rms_norm_eps, cfg.norm_offset)


def _activation(cfg: ModelConfig, x):
    if cfg.hidden_act == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def soft_cap(x, cap: float | None):
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); identity when ``cap`` is None."""
    if cap is None:
        return x
    return cap * jnp.tanh(x / cap)


def _linear(x, layer: Params, w: str, b: str):
    y = quant.matmul(x, layer[w], layer.get(quant.scale_key(w)))
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Packing:
    """Gathers between the block layout of a step's rows ([T]: decode rows, then prompt blocks)
    and its packed layout ([N]: decode rows, then the valid prompt rows, then fill rows)."""

    packed: Int[Array, " n"]  # each packed row's row in the block layout
    blocks: Int[Array, " t"]  # each block row's packed row (a padding row: a nearby valid one)
    filled: Bool[Array, " n"]  # packed rows that hold a token (decode rows always count)

    @classmethod
    def of(cls, positions: Int[Array, " t"], num_decode: int, packed_rows: int) -> Packing:
        """The packing of the prompt region's valid rows (position >= 0) into ``packed_rows``
        rows (at least as many as are valid: the scheduler's token budget)."""
        valid = positions[num_decode:] >= 0  # [R]
        count = jnp.sum(valid)
        take = jnp.nonzero(valid, size=packed_rows, fill_value=0)[0]  # [P] valid rows first
        fill = jnp.arange(packed_rows) >= count
        take = jnp.where(fill, take[0], take)  # fill rows copy a valid row (finite values)
        rank = jnp.clip(jnp.cumsum(valid) - 1, 0, packed_rows - 1)  # [R]
        decode = jnp.arange(num_decode)
        return cls(
            packed=jnp.concatenate([decode, num_decode + take]),
            blocks=jnp.concatenate([decode, num_decode + rank]),
            filled=jnp.concatenate([jnp.ones(num_decode, bool), ~fill]),
        )


def _entries(slots, page_tables, num_decode: int, block_q: int, t: int):
    """(row_entry [T], entry_tables [E, MP]): each decode row and each prompt block of the flat
    batch is one entry of the ragged kernels (``pallas_kernels.ragged_rows``)."""
    num_blocks = (t - num_decode) // block_q
    row_entry = np.concatenate(
        [np.arange(num_decode), num_decode + np.repeat(np.arange(num_blocks), block_q)]
    ).astype(np.int32)  # [T] static
    entry_rows = np.concatenate(
        [np.arange(num_decode), num_decode + block_q * np.arange(num_blocks)]
    ).astype(np.int32)  # [E] first row of each entry (static)
    entry_slots = jnp.clip(slots[entry_rows], 0, page_tables.shape[0] - 1)  # [E]
    return jnp.asarray(row_entry), page_tables[entry_slots]


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
    scale: float | None = None,
    logit_cap: float | None = None,
    decode_block: int = 1,
) -> Float[Array, "t h d"]:
    """``decode_block`` > 1: the decode rows come in groups of that many rows of one sequence
    (speculative steps), which the XLA paths attend as one block (one page-table walk per
    group, not per row)."""
    t, h, d = q.shape
    kp, vp = cache.pages(layer)  # [P, S, KVH, D] each (views of the TPU layout)
    scales = dict(zip(("k_scales", "v_scales"), cache.scales(layer)))  # 8-bit pools: [P, S, KVH]
    impl = resolve_impl(impl, q, kp)
    if impl in (*PALLAS_IMPLS, "tpu"):
        # One ragged kernel call: every decode row and every prompt block is its own entry.
        row_entry, entry_tables = _entries(slots, page_tables, num_decode, block_q, t)
        kw = dict(sliding_window=sliding_window, scale=scale, soft_cap=logit_cap)
        if impl == "tpu":
            kv, lay = cache.tpu_pool(layer)
            return tpu_paged_attention_rows(q, kv, row_entry, entry_tables, positions, lay, **kw)
        return paged_attention_rows(
            q,
            kp,
            vp,
            row_entry,
            entry_tables,
            positions,
            max_query_len=block_q if t > num_decode else 1,
            interpret=impl == "pallas_interpret",
            **kw,
            **scales,
        )
    outs = []
    if num_decode:
        nb, bd = num_decode // decode_block, decode_block
        block_slots = jnp.clip(slots[:num_decode:bd], 0, page_tables.shape[0] - 1)  # [Nd / Bd]
        o = paged_attention(
            q[:num_decode].reshape(nb, bd, h, d),  # [Nd / Bd, Bd, H, D]
            kp,
            vp,
            page_tables[block_slots],
            positions[:num_decode].reshape(nb, bd),
            sliding_window=sliding_window,
            scale=scale,
            soft_cap=logit_cap,
            impl=impl,
            **scales,
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
            scale=scale,
            soft_cap=logit_cap,
            impl=impl,
            **scales,
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
    decode_block: int = 1,
    packed_rows: int | None = None,
) -> tuple[Float[Array, "t e"], KVCache]:
    """Run the decoder over a flat token batch; returns final-norm hidden states and the pool.
    ``packed_rows``: the prompt region's valid rows, packed into that many rows, are all the
    dense layers compute (module doc).

    ``attention`` replaces the per-layer attention call (same arguments as ``_attention``);
    tensor parallelism passes a ``shard_map`` of it (``jbatch.parallel.attention``), and
    likewise ``experts`` for :func:`jbatch.models.moe.expert_outputs`. ``decode_block``: the
    decode rows are groups of that many rows of one sequence each (``_attention``)."""
    attend = _attention if attention is None else attention
    if decode_block > 1:
        if attention is not None or num_decode % decode_block:
            raise ValueError(
                f"decode_block={decode_block} needs the built-in attention and a multiple of "
                f"it as num_decode={num_decode}"
            )
        attend = functools.partial(_attention, decode_block=decode_block)
    t = tokens.shape[0]
    if num_decode > t or (t - num_decode) % block_q:
        raise ValueError(
            f"token batch of {t} rows does not split into {num_decode} decode rows plus "
            f"blocks of block_q={block_q}"
        )
    h_, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    block_positions, block_slots = positions, slots  # attention's layout
    packing = None
    if packed_rows is not None:  # the dense layers run on the packed rows
        packing = Packing.of(positions, num_decode, packed_rows)
        tokens, slots = tokens[packing.packed], slots[packing.packed]
        positions = jnp.where(packing.filled, positions[packing.packed], -1)
        t = num_decode + packed_rows
    x = quant.embed_rows(params, jnp.clip(tokens, 0, cfg.vocab_size - 1))  # [T, E]
    if cfg.embed_multiplier != 1.0:
        x = x * jnp.asarray(cfg.embed_multiplier, x.dtype)  # rounded to x's dtype, as HF does
    tables: dict[Rope, tuple] = {r: rope_tables(r, d, positions) for r in set(cfg.ropes)}
    pages, offsets = write_locations(
        page_tables, slots, positions, cache.page_size, cache.num_pages
    )
    for i in range(cfg.num_layers):
        lp = _layer(params, cfg, i)
        xn = _norm(cfg, x, lp["attn_norm"])
        q = _linear(xn, lp, "wq", "bq").reshape(t, h_, d)
        k = _linear(xn, lp, "wk", "bk").reshape(t, kvh, d)
        v = _linear(xn, lp, "wv", "bv").reshape(t, kvh, d)
        if cfg.qk_norm:
            q, k = _norm(cfg, q, lp["q_norm"]), _norm(cfg, k, lp["k_norm"])
        cos, sin = tables[cfg.ropes[i]]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = write_layer(cache, i, k, v, pages, offsets)
        attn = attend(
            q if packing is None else q[packing.blocks],
            cache,
            i,
            block_slots,
            block_positions,
            page_tables,
            num_decode,
            block_q,
            cfg.sliding_windows[i],
            attn_impl,
            cfg.attn_scale,
            cfg.attn_soft_cap,
        )
        attn = attn if packing is None else attn[packing.packed]
        out = _linear(attn.reshape(t, h_ * d), lp, "wo", "bo")
        x = x + (_norm(cfg, out, lp["post_attn_norm"]) if cfg.sandwich_norms else out)
        xn = _norm(cfg, x, lp["mlp_norm"])
        if cfg.moe_layers[i]:  # routed experts (jbatch.models.moe)
            out = moe.sparse_mlp(lp, cfg, xn, positions >= 0, experts)
        else:
            gate = _linear(xn, lp, "w_gate", "b_gate")
            up = _linear(xn, lp, "w_up", "b_up")
            out = _linear(_activation(cfg, gate) * up, lp, "w_down", "b_down")
        x = x + (_norm(cfg, out, lp["post_mlp_norm"]) if cfg.sandwich_norms else out)
    hidden = _norm(cfg, x, params["final_norm"])
    return (hidden if packing is None else hidden[packing.blocks]), cache


def compute_logits(
    params: Params, hidden: Float[Array, "n e"], cfg: ModelConfig
) -> Float[Array, "n vocab"]:
    """LM head (tied to the embedding when the checkpoint has no ``lm_head``), in float32, with
    the model's final soft cap (Gemma 2)."""
    if HEAD_T in params:  # XLA:CPU's [E, V] copy (``lm_head.py``)
        logits = quant.matmul(hidden, params[HEAD_T], params.get(quant.scale_key(HEAD_T)))
    else:
        key = quant.head_key(params)  # [V, E]: rows stream contiguously
        logits = quant.matmul_t(hidden, params[key], params.get(quant.scale_key(key)))
    return soft_cap(logits.astype(jnp.float32), cfg.final_soft_cap)
