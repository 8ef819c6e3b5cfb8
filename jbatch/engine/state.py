"""EngineState: the whole device side of the engine as one typed pytree of fixed-shape arrays.

Every array has a slot axis of ``max_slots`` rows (or is the KV pool), so its shape never depends
on the workload. The jitted functions in ``core.py`` take it donated and return it updated.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int32

from jbatch.engine import buckets
from jbatch.engine.config import EngineConfig
from jbatch.engine.sampler import SlotSampling
from jbatch.models.config import ModelConfig
from jbatch.models.kv_cache import KVCache


@struct.dataclass
class EngineState:
    cache: KVCache  # per layer [P, S, KVH, D] K and V (8-bit pools: plus [P, S, KVH] scales)
    # Page ids of each slot's sequence; unassigned entries hold num_pages (out of bounds: writes
    # through them are dropped, reads are masked by position).
    page_tables: Int32[Array, "slots max_pages"]
    tokens: Int32[Array, " slots"]  # last sampled token: the next decode input
    seq_lens: Int32[Array, " slots"]  # tokens whose K/V is in the pool
    prefill_lens: Int32[Array, " slots"]  # tokens to prefill before decoding starts
    prompt_lens: Int32[Array, " slots"]  # original prompt; prefilled tokens past it are outputs
    active: Bool[Array, " slots"]
    num_generated: Int32[Array, " slots"]  # samples drawn so far (the per-request RNG counter)
    max_tokens: Int32[Array, " slots"]  # decoding stops when num_generated reaches this
    sampling: SlotSampling  # per-slot temperature, top-k/p, min-p, penalties, seed
    prompt_mask: Bool[Array, "slots vocab"]  # tokens seen in the prompt (repetition penalty)
    output_counts: Int32[Array, "slots vocab"]  # generated-token counts (presence/frequency)
    # Speculative decoding with a draft model: its own pool beside ``cache`` (same pages and
    # page tables, the draft's shape; ``engine/draft_proposer.py``). None without a draft.
    draft_cache: KVCache | None = None
    # N-gram speculative decoding: the tokens each slot's last speculative dispatch emitted,
    # all but the last (the next dispatch's lookup completes its stream with them;
    # ``spec_block.py``), at most ``buckets.spec_extra``.
    spec_emitted: Int32[Array, "slots extra"] | None = None

    @property
    def max_slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def decode_mask(self) -> Bool[Array, " slots"]:
        """Slots that decode one token in the next step (prompt done, budget left, room left)."""
        max_len = self.page_tables.shape[1] * self.cache.page_size
        return decodes(
            self.active, self.seq_lens, self.prefill_lens, self.num_generated, self.max_tokens,
            max_len,
        )  # fmt: skip


def decodes(active, seq_lens, prefill_lens, num_generated, max_tokens, max_len):
    """The decode rule, once: active, prompt done, token budget left, room left. Works on the
    device arrays, on the numpy ``MockCore``'s, and on one request's host counters."""
    return active & (seq_lens >= prefill_lens) & (num_generated < max_tokens) & (seq_lens < max_len)


def init_state(
    model_cfg: ModelConfig, cfg: EngineConfig, draft_cfg: ModelConfig | None = None
) -> EngineState:
    """A fresh state: empty slots and a zeroed KV pool (finite values only, never NaN); with
    ``draft_cfg``, a zeroed draft pool too."""
    s = cfg.max_slots
    zeros = lambda: jnp.zeros((s,), jnp.int32)  # distinct buffers: each field is donated
    pool = lambda m: KVCache.zeros(
        m, cfg.num_pages, cfg.page_size, cfg.kv_storage_dtype, cfg.tpu_kv_layout
    )
    return EngineState(
        cache=pool(model_cfg),
        draft_cache=None if draft_cfg is None else pool(draft_cfg),
        spec_emitted=(
            jnp.zeros((s, buckets.spec_extra(cfg)), jnp.int32)
            if cfg.speculative == "ngram"
            else None
        ),
        page_tables=jnp.full((s, cfg.max_pages_per_seq), cfg.num_pages, jnp.int32),
        tokens=zeros(),
        seq_lens=zeros(),
        prefill_lens=zeros(),
        prompt_lens=zeros(),
        active=jnp.zeros((s,), bool),
        num_generated=zeros(),
        max_tokens=zeros(),
        sampling=SlotSampling.neutral(s),
        prompt_mask=jnp.zeros((s, model_cfg.vocab_size), bool),
        output_counts=jnp.zeros((s, model_cfg.vocab_size), jnp.int32),
    )
