"""The routed-experts MLP of a mixture-of-experts layer (Mixtral, Qwen3-MoE), fixed shapes.

Over the flat token buffer ``x [T, E]`` of the forward pass (see ``jbatch.models.llama``):

1. **Route**: router logits ``x @ router`` in the model dtype (as HF computes them), softmax in
   float32, top-k experts per token; the k weights are renormalised to sum to 1 when
   ``cfg.norm_topk_prob`` (Mixtral always, Qwen3-MoE as configured).
2. **Dispatch**: the ``T * k`` (token, expert) assignments are sorted by expert. Padding rows
   (position -1) are parked in a group of their own past the last expert, so they take no
   expert's compute and cannot change any other row (every row's output depends only on its own
   input and its expert's weights).
3. **Experts** (SiLU GLU, ``down(silu(x @ gate) * (x @ up))``) run as a grouped matmul, either
   - ``"blocks"`` (default): each expert's assignments are padded to a multiple of ``block``
     rows in one fixed-size buffer, and a ``while`` loop runs only the blocks in use, each
     against its own expert's weights: cost O(T * k + experts * block) rows, or
   - ``"ragged_dot"``: three ``jax.lax.ragged_dot`` calls over the sorted rows. XLA's generic
     lowering (CPU; GPU without a grouped-GEMM library) expands it to a masked dense matmul
     over all experts, O(T * k * experts): 3-18x slower than ``"blocks"`` on CPU (see
     docs/architecture.md, "Mixture of experts"); it is kept for backends with a native
     grouped matmul.
4. **Combine**: each token's k outputs, weighted, summed (float32), cast to the model dtype.

Tensor parallelism splits every expert's intermediate dimension (``jbatch.parallel.experts``):
:func:`expert_outputs` runs unchanged on each shard, followed by one all-reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jbatch.models.config import ModelConfig

Params = dict
IMPLS = ("blocks", "ragged_dot")


def route(
    x: Float[Array, "t e"], router: Float[Array, "e n"], cfg: ModelConfig
) -> tuple[Float[Array, "t k"], Int[Array, "t k"]]:
    """Top-k routing weights (float32) and expert ids of every row."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def block_size(num_assignments: int, num_experts: int) -> int:
    """Rows per block: about one block per expert on average, a power of two in [8, 64]."""
    per_expert = -(-num_assignments // num_experts)
    return min(64, max(8, 1 << max(0, per_expert - 1).bit_length()))


def _block_layout(experts: Int[Array, " m"], num_experts: int, block: int):
    """Where each assignment goes in the block buffer, and each block's expert.

    ``experts`` holds one expert id per assignment, ``num_experts`` for parked (padding) ones.
    Returns ``dest [M]`` (row in the buffer; parked: one past its end), ``block_expert [NB]``
    and ``used`` (blocks in use, a traced scalar: the rest of the buffer is never read)."""
    m = experts.shape[0]
    num_blocks = m // block + min(num_experts, m)  # every expert adds at most one partial block
    counts = jnp.zeros(num_experts, jnp.int32).at[experts].add(1, mode="drop")  # [N]
    padded = (counts + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    start, padded_start = jnp.cumsum(counts) - counts, padded_end - padded
    order = jnp.argsort(experts, stable=True)  # assignments sorted by expert, parked last
    sorted_e = experts[order]
    e = jnp.minimum(sorted_e, num_experts - 1)
    rank = jnp.arange(m, dtype=jnp.int32) - start[e]  # rank within its expert
    dest_sorted = jnp.where(sorted_e < num_experts, padded_start[e] + rank, num_blocks * block)
    dest = jnp.zeros(m, jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))
    first_row = jnp.arange(num_blocks, dtype=jnp.int32) * block
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_end, first_row, side="right"), num_experts - 1
    )
    return dest, block_expert.astype(jnp.int32), padded_end[-1] // block, num_blocks


def _glu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _experts_blocks(rows, experts, w_gate, w_up, w_down):
    """``rows [M, E]`` through expert ``experts[m]`` each, by blocks (see the module doc)."""
    m, e = rows.shape
    n = w_gate.shape[0]
    block = block_size(m, n)
    dest, block_expert, used, num_blocks = _block_layout(experts, n, block)
    buf = jnp.zeros((num_blocks * block, e), rows.dtype).at[dest].set(rows, mode="drop")
    buf = buf.reshape(num_blocks, block, e)

    def body(b, out):
        j = block_expert[b]
        return out.at[b].set(_glu(buf[b], w_gate[j], w_up[j], w_down[j]))

    out = jax.lax.fori_loop(0, used, body, jnp.zeros_like(buf))
    return out.reshape(num_blocks * block, e).at[dest].get(mode="fill", fill_value=0)


def _experts_ragged(rows, experts, w_gate, w_up, w_down):
    """The same with ``jax.lax.ragged_dot`` over the rows sorted by expert."""
    n = w_gate.shape[0]
    order = jnp.argsort(experts, stable=True)
    sizes = jnp.zeros(n, jnp.int32).at[experts].add(1, mode="drop")  # parked rows: no group
    xs = rows[order]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, sizes)) * jax.lax.ragged_dot(xs, w_up, sizes)
    ys = jax.lax.ragged_dot(h, w_down, sizes)
    return jnp.zeros_like(ys).at[order].set(ys)


def expert_outputs(
    x: Float[Array, "t e"],
    weights: Float[Array, "t k"],
    ids: Int[Array, "t k"],
    valid: Bool[Array, " t"],
    w_gate: Float[Array, "n e f"],
    w_up: Float[Array, "n e f"],
    w_down: Float[Array, "n f e"],
    impl: str = "blocks",
) -> Float[Array, "t e"]:
    """Sum over each row's k experts of weight x expert MLP(row); padding rows get 0."""
    if impl not in IMPLS:
        raise ValueError(f"moe impl={impl!r} is not one of {IMPLS}")
    t, k = ids.shape
    n = w_gate.shape[0]
    experts = jnp.where(valid[:, None], ids, n).reshape(t * k)  # padding: parked
    rows = jnp.repeat(x, k, axis=0)  # assignment a = (token a // k, its (a % k)-th expert)
    run = _experts_blocks if impl == "blocks" else _experts_ragged
    y = run(rows, experts, w_gate, w_up, w_down).reshape(t, k, -1)
    y = jnp.where(valid[:, None, None], y.astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tke->te", weights, y).astype(x.dtype)


def sparse_mlp(
    lp: Params,
    cfg: ModelConfig,
    x: Float[Array, "t e"],
    valid: Bool[Array, " t"],
    experts=None,
    impl: str = "blocks",
) -> Float[Array, "t e"]:
    """The MoE block of one layer (``lp``: its ``router`` and ``expert_*`` params).
    ``experts`` replaces :func:`expert_outputs` (tensor parallelism: per shard)."""
    weights, ids = route(x, lp["router"], cfg)
    run = expert_outputs if experts is None else experts
    return run(x, weights, ids, valid, lp["expert_gate"], lp["expert_up"], lp["expert_down"], impl)
