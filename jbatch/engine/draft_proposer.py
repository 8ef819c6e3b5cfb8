"""The draft-model proposer of speculative decoding: pure, jit-able functions over a draft KV pool.

The draft keeps its own pool beside the target's: the same page ids and page tables (the
scheduler allocates pages once), a separate :class:`KVCache` of the draft's shape. The pool stays
valid because the draft runs over every token the target computes:

* every prefill / mixed step program runs :func:`draft_forward` over its flat token buffer (the
  draft's hidden states are discarded, so XLA drops its final norm and its last layer's
  attention and MLP; there is no LM head);
* the spec step program runs :func:`propose` first. Its ``K + 1`` one-row-per-group decodes
  write the draft's K/V of exactly the rows the target then verifies (the slot's last token at
  ``seq_lens`` and its ``num_drafts`` proposals after it), so that program needs no
  ``draft_forward``. Rejected positions hold stale K/V in both pools and are overwritten later,
  the same rule for both.

So at page id ``p`` the draft pool holds the draft's K/V of the same tokens the target pool holds
at ``p`` (prefix-cache hits included; swaps copy both pools, snapshots save both).

Proposals follow the request's sampling settings (temperature, top-k, top-p, min-p through
:func:`jbatch.engine.sampler.filtered_logits`; penalties and structured-output masks are not
applied to the draft — rejection sampling stays exact for any draft distribution, they only
lower acceptance). Greedy rows take the argmax and report a one-hot ``q``. Draft draw ``i`` of a
request uses the uniform of ``fold_in(fold_in(key(seed), num_generated + i), DRAFT_STREAM)``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Int32

from jbatch.converted import load_weights
from jbatch.engine.config import EngineConfig
from jbatch.engine.sampler import SlotSampling, argmax, filtered_logits, inverse_cdf, uniforms
from jbatch.engine.spec_verify import DRAFT_STREAM
from jbatch.engine.state import EngineState
from jbatch.models.config import ModelConfig
from jbatch.models.kv_cache import KVCache
from jbatch.models.llama import compute_logits, forward, unstack_layers
from jbatch.models.lm_head import with_cpu_head
from jbatch.sampling_params import is_greedy
from jbatch.tokenizer import Tokenizer

DRAFT_PARAMS = "draft"  # the draft model's params, as an entry of the engine's params dict


def draft_forward(
    draft_params: dict,
    draft_cfg: ModelConfig,
    draft_cache: KVCache,
    tokens: Int[Array, " t"],
    positions: Int[Array, " t"],
    slots: Int[Array, " t"],
    page_tables: Int[Array, "slots max_pages"],
    *,
    num_decode: int,
    block_q: int = 1,
    attn_impl: str = "auto",
) -> KVCache:
    """The draft model over a step's flat token buffer (the target's layout); returns its pool."""
    _, cache = forward(
        draft_params, draft_cfg, draft_cache, tokens, positions, slots, page_tables,
        num_decode=num_decode, block_q=block_q, attn_impl=attn_impl,
    )  # fmt: skip
    return cache


def _draw(
    logits: Float[Array, "g vocab"],
    sampling: SlotSampling,
    step_index: Int32[Array, " g"],
) -> tuple[Int32[Array, " g"], Float[Array, "g vocab"]]:
    """One draft token per group and the distribution ``q`` it was drawn from."""
    greedy = is_greedy(sampling.temperature)  # [G]
    top = argmax(logits)  # [G]
    one_hot = jax.nn.one_hot(top, logits.shape[-1], dtype=jnp.float32)  # [G, V]

    def sampled():
        masked = filtered_logits(logits, sampling, greedy)  # [G, V]
        tok = inverse_cdf(masked, uniforms(sampling.seed, step_index, DRAFT_STREAM))  # [G]
        q = jax.nn.softmax(masked, axis=-1)  # [G, V]
        return jnp.where(greedy, top, tok), jnp.where(greedy[:, None], one_hot, q)

    return jax.lax.cond(jnp.all(greedy), lambda: (top, one_hot), sampled)


def propose(
    draft_params: dict,
    draft_cfg: ModelConfig,
    draft_cache: KVCache,
    last_tokens: Int[Array, " g"],
    positions: Int[Array, " g"],
    slots: Int[Array, " g"],
    page_tables: Int[Array, "slots max_pages"],
    sampling: SlotSampling,
    step_index: Int32[Array, " g"],
    num_drafts: Int32[Array, " g"] | None = None,
    *,
    num_tokens: int,
    block_q: int = 1,
    attn_impl: str = "auto",
) -> tuple[KVCache, Int32[Array, "g k"], Float[Array, "g k vocab"]]:
    """``num_tokens`` (K) draft tokens per group, from its last token at ``positions``.

    Iteration ``i`` (0..K) decodes ``x_i`` at ``positions + i`` (``x_0 = last_tokens``,
    ``x_i = d_i``) for every group at once, writing its K/V; iterations ``i < K`` draw
    ``d_{i+1}`` under the group's ``sampling`` (gathered per group) with RNG counter
    ``step_index + i``. ``num_drafts`` (default K): the proposals the target will verify; only
    rows ``0..num_drafts`` are written (the rows the target writes, whose pages the host
    assigned: past them a page-table entry may be stale) and proposals past ``num_drafts`` are
    returned as token 0 and ``q = 0``. Groups at position -1 are padding: they write nothing and
    return token 0 and ``q = 0``; rows past the page table's capacity are not written either.
    Returns (draft pool, drafts ``[G, K]``, their distributions ``q`` ``[G, K, V]`` float32).
    """
    g, k, vocab = last_tokens.shape[0], num_tokens, draft_cfg.vocab_size
    max_len = page_tables.shape[1] * draft_cache.page_size
    nd = jnp.full((g,), k, jnp.int32) if num_drafts is None else num_drafts
    nd = jnp.where(positions >= 0, jnp.clip(nd, 0, k), -1)  # [G]; -1: padding, no row at all
    row_on = lambda i: (i <= nd) & (positions + i < max_len)  # [G]
    fwd = lambda cache, tok, i: forward(
        draft_params, draft_cfg, cache, tok, jnp.where(row_on(i), positions + i, -1), slots,
        page_tables, num_decode=g, block_q=block_q, attn_impl=attn_impl,
    )  # fmt: skip

    def body(i, carry):
        cache, tok, drafts, probs = carry
        hidden, cache = fwd(cache, tok, i)
        logits = compute_logits(draft_params, hidden, draft_cfg)  # [G, V] float32
        tok, q = _draw(logits, sampling, step_index + i)
        drafts = jax.lax.dynamic_update_slice(drafts, tok[:, None], (0, i))
        probs = jax.lax.dynamic_update_slice(probs, q[:, None], (0, i, 0))
        return cache, tok, drafts, probs

    init = (
        draft_cache,
        last_tokens.astype(jnp.int32),
        jnp.zeros((g, k), jnp.int32),
        jnp.zeros((g, k, vocab), jnp.float32),
    )
    cache, last, drafts, probs = jax.lax.fori_loop(0, k, body, init)
    _, cache = fwd(cache, last, k)  # d_K's K/V; its own proposal would be discarded
    offered = jnp.arange(k)[None, :] < nd[:, None]  # [G, K]
    drafts = jnp.where(offered, drafts, 0)
    probs = jnp.where(offered[..., None], probs, 0.0)
    return cache, drafts, probs


def step_draft_cache(
    params: dict,
    draft_cfg: ModelConfig | None,
    state: EngineState,
    tokens: Int[Array, " t"],
    positions: Int[Array, " t"],
    slots: Int[Array, " t"],
    page_tables: Int[Array, "slots max_pages"],
    **forward_kwargs,
) -> KVCache | None:
    """An ordinary step's hook (``core.step_forward``): the draft over the step's token buffer,
    or no pool at all without a draft (``forward_kwargs``: ``num_decode``, ``block_q``,
    ``attn_impl``)."""
    if draft_cfg is None:
        return state.draft_cache
    return draft_forward(
        params[DRAFT_PARAMS], draft_cfg, state.draft_cache, tokens, positions, slots,
        page_tables, **forward_kwargs,
    )  # fmt: skip


def spec_drafts(
    params: dict,
    draft_cfg: ModelConfig,
    state: EngineState,
    group_slots: Int32[Array, " g"],
    live: Bool[Array, " g"],
    num_drafts: Int32[Array, " g"],
    page_tables: Int[Array, "slots max_pages"],
    sampling: SlotSampling,
    *,
    num_tokens: int,
    block_q: int = 1,
    attn_impl: str = "auto",
) -> tuple[KVCache, Int32[Array, "g k"], Float[Array, "g k vocab"]]:
    """The speculative step's hook (``spec_step.spec_step``): :func:`propose` from each live
    group's last token at ``seq_lens`` (other groups are padding), writing exactly the rows the
    target writes: row 0 of every live group — also one the host gave no proposals (a request
    that does not speculate) — and its ``num_drafts`` proposal rows."""
    positions = jnp.where(live, state.seq_lens[group_slots], -1)
    return propose(
        params[DRAFT_PARAMS], draft_cfg, state.draft_cache, state.tokens[group_slots], positions,
        group_slots, page_tables, sampling, state.num_generated[group_slots], num_drafts,
        num_tokens=num_tokens, block_q=block_q, attn_impl=attn_impl,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A loaded draft checkpoint: its config and params (the engine's layout)."""

    cfg: ModelConfig
    params: dict


def check_draft(
    draft_cfg: ModelConfig,
    target_cfg: ModelConfig,
    draft_tokenizer: Tokenizer | None = None,
    target_tokenizer: Tokenizer | None = None,
) -> None:
    """A draft must propose the target's token ids: same vocabulary size, and the same
    tokenizer vocabulary when both checkpoints ship one (ValueError otherwise)."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"draft model vocab_size={draft_cfg.vocab_size} differs from the target's "
            f"vocab_size={target_cfg.vocab_size}; a draft must share the target's vocabulary"
        )
    if draft_tokenizer is None or target_tokenizer is None:
        return
    vocab = lambda t: t.backend.get_vocab(with_added_tokens=True)
    if vocab(draft_tokenizer) != vocab(target_tokenizer):
        raise ValueError(
            f"draft tokenizer ({draft_tokenizer.vocab_size} tokens) does not match the target's "
            f"({target_tokenizer.vocab_size} tokens): a draft must use the target's tokenizer"
        )


def load_draft(
    draft_dir: str | Path,
    target_cfg: ModelConfig,
    config: EngineConfig,
    target_tokenizer: Tokenizer | None = None,
) -> DraftModel:
    """Load a draft checkpoint with the target's loader and engine dtype (checked by
    :func:`check_draft` before any weight is read)."""
    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise FileNotFoundError(f"{draft_dir}: draft model directory not found")
    if config.tp * config.dp > 1:
        raise ValueError(f"a draft model runs on one device, not tp={config.tp} dp={config.dp}")
    cfg = ModelConfig.from_file(draft_dir / "config.json")
    check_draft(cfg, target_cfg, Tokenizer.from_dir(draft_dir), target_tokenizer)
    params = load_weights(draft_dir, cfg, config)
    return DraftModel(cfg, with_cpu_head(unstack_layers(params)))  # as the target's
