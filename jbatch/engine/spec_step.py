"""The speculative step: decode rows in groups of K + 1, verified on the device.

A decode-only step in which slots speculate (``EngineConfig.speculative``), run by the
speculative program (``spec_block.py``: one such step, or a block of them). Its token buffer
is ``groups`` groups of ``K + 1`` decode rows (``K = num_speculative_tokens``; ``groups`` is a
bucket of ``buckets.spec_buckets``):

1. apply page-table writes (the host gave each group pages for all its rows);
2. group ``g`` is slot ``group_slots[g]``: row 0 feeds its last token at position
   ``seq_lens[slot]``, rows ``1..num_drafts[g]`` the proposals at the next positions, the rest
   is padding (position -1). The proposals come from a draft model run here, or from n-gram
   lookup run here (``ngram_device``) over the group's stream (``ngram_stream``: the stream
   the host has read — sent as a window ending at ``anchor`` — completed with what the host
   cannot know yet, since the dispatch was planned while the previous one ran: the tokens
   that one emitted, kept in ``spec_emitted``, and the slot's last token). Either way at
   most what is left of ``max_drafts`` (the rows the host gave pages for), and no more than
   the token budget and the pool allow (``lookup_drafts``). The model writes every row's K/V
   through the page table and each row attends to the slot's pages up to its own position
   (``llama.forward``'s decode rows);
3. the LM head runs on every row; ``spec_verify.verify`` accepts a prefix of the proposals
   and draws the token after it (row 0 gets penalties and the token bitmask first: a slot with
   either has no proposals);
4. each slot advances by its emitted count: ``seq_lens`` (the last token and the accepted
   proposals now have valid K/V; the rejected rows' K/V is overwritten later), ``tokens``
   (the last emitted), ``num_generated`` and the output counts.

A slot with no proposals (``num_drafts`` 0) decodes exactly as in an ordinary step. The result is
packed ahead of an ordinary :class:`core.StepOutput` (row 0 of each slot: its first emitted
token, logprob and top logprobs), so the host reads both with one copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int32

from jbatch.engine import buckets, ngram_device
from jbatch.engine.config import EngineConfig
from jbatch.engine.core import StepOutput
from jbatch.engine.draft_proposer import spec_drafts
from jbatch.engine.logprobs import TopLogprobs, sampled_top_logprobs
from jbatch.engine.sampler import processed_logits
from jbatch.engine.spec_verify import emitted_logprobs, verify
from jbatch.engine.state import EngineState
from jbatch.models.config import ModelConfig
from jbatch.models.llama import compute_logits, forward


@struct.dataclass
class SpecBatch:
    """Host inputs of a speculative dispatch (padding groups: slot ``max_slots``): ``steps``
    speculative steps (``spec_block.py``; 1 unless ``decode_steps`` > 1). ``max_drafts``: the
    tokens past its first the group may emit in the dispatch (the host gave pages for them);
    ``propose``: whether the group proposes (False: it decodes one token a step). For n-gram
    proposals, the stream as far as the host has read it: its last ``window_len`` tokens,
    ending at stream index ``anchor`` (the device completes it: ``ngram_device``)."""

    steps: Int32[Array, " 1"]
    group_slots: Int32[Array, " groups"]
    max_drafts: Int32[Array, " groups"]
    propose: Bool[Array, " groups"]
    anchor: Int32[Array, " groups"]
    window_len: Int32[Array, " groups"]
    window: Int32[Array, "groups w"]  # w = buckets.ngram_window(cfg)
    write_slots: Int32[Array, " writes"]
    write_index: Int32[Array, " writes"]
    write_pages: Int32[Array, " writes"]
    want_top_logprobs: Bool[Array, " slots"]

    @classmethod
    def empty(cls, cfg: EngineConfig, groups: int) -> SpecBatch:
        allowed = buckets.spec_buckets(cfg)
        if groups not in allowed:
            raise ValueError(f"groups={groups} is not a speculative bucket {allowed}")
        s, w = cfg.max_slots, buckets.max_spec_page_writes(cfg)
        zeros = lambda: np.zeros(groups, np.int32)
        return cls(
            steps=np.ones(1, np.int32),
            group_slots=np.full(groups, s, np.int32),
            max_drafts=zeros(),
            propose=np.zeros(groups, bool),
            anchor=zeros(),
            window_len=zeros(),
            window=np.zeros((groups, buckets.ngram_window(cfg)), np.int32),
            write_slots=np.full(w, s, np.int32),
            write_index=np.zeros(w, np.int32),
            write_pages=np.zeros(w, np.int32),
            want_top_logprobs=np.zeros(s, bool),
        )


@struct.dataclass
class SpecOutput:
    """Per group: the emitted tokens (valid up to ``count``), their logprobs, the count, and
    the proposals verified."""

    tokens: Int32[Array, "groups k1"]
    logprobs: Float[Array, "groups k1"]
    count: Int32[Array, " groups"]
    num_drafts: Int32[Array, " groups"]


def spec_step(
    params: dict,
    state: EngineState,
    batch: SpecBatch,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    *,
    used: Int32[Array, " groups"],
    stream: tuple[Int32[Array, "groups t"], Int32[Array, " groups"]] | None,
    model_cfg: ModelConfig,
    block_q: int,
    num_speculative_tokens: int,
    ngram: tuple[int, int] = (1, 1),
    attn_impl: str = "auto",
    draft_cfg: ModelConfig | None = None,
) -> tuple[EngineState, StepOutput, SpecOutput]:
    """One speculative step (module doc) of a dispatch in which each group already emitted
    ``used`` tokens (``spec_block.py``). ``stream``: each group's token stream and its length,
    ending with the slot's last token (n-gram lookup; ``ngram``: (min, max) n); None: a draft
    model (``draft_cfg``) proposes on the device (``draft_proposer.spec_drafts``)."""
    s, g, k = state.max_slots, batch.group_slots.shape[0], num_speculative_tokens
    k1 = k + 1
    page_tables = state.page_tables.at[batch.write_slots, batch.write_index].set(
        batch.write_pages, mode="drop"
    )
    gs = batch.group_slots
    gs_c = jnp.clip(gs, 0, s - 1)  # [G]
    live = group_live(state, batch, used)  # [G]
    cap = jnp.where(batch.propose, jnp.clip(batch.max_drafts - used, 0, k), 0)
    drafts, num_drafts = lookup_drafts(state, gs_c, cap, k, stream, ngram)
    num_drafts = jnp.where(live, num_drafts, 0)  # [G]
    j = jnp.arange(k1, dtype=jnp.int32)[None, :]  # [1, K1]
    rows_on = live[:, None] & (j <= num_drafts[:, None])  # [G, K1]
    sp = jax.tree.map(lambda a: a[gs_c], state.sampling)
    draft_probs, draft_cache = None, state.draft_cache
    if draft_cfg is not None:
        draft_cache, drafts, draft_probs = spec_drafts(
            params, draft_cfg, state, gs_c, live, num_drafts, page_tables, sp, num_tokens=k,
            block_q=block_q, attn_impl=attn_impl,
        )  # fmt: skip
    tokens = jnp.concatenate([state.tokens[gs_c][:, None], drafts], axis=1)
    positions = jnp.where(rows_on, state.seq_lens[gs_c][:, None] + j, -1)  # [G, K1]
    slots = jnp.broadcast_to(gs_c[:, None], (g, k1))
    hidden, cache = forward(
        params, model_cfg, state.cache, tokens.ravel(), positions.ravel(), slots.ravel(),
        page_tables, num_decode=g * k1, block_q=block_q, attn_impl=attn_impl, decode_block=k1,
    )  # fmt: skip
    logits = compute_logits(params, hidden, model_cfg).reshape(g, k1, -1)  # [G, K1, V]

    allowed = None if token_bitmask is None else token_bitmask[gs_c]
    row0 = processed_logits(
        logits[:, 0], sp, state.prompt_mask[gs_c], state.output_counts[gs_c], allowed
    )  # [G, V]
    x = logits.at[:, 0].set(row0)
    emitted, count = verify(x, drafts, num_drafts, sp, state.num_generated[gs_c], draft_probs)
    count = jnp.where(live, count, 0)  # [G]
    logprobs = emitted_logprobs(logits, emitted)  # [G, K1]

    # Advance each slot by its emitted count (padding groups scatter to slot S: dropped).
    target = jnp.where(live, gs, s)  # [G]
    advance = jnp.zeros(s, jnp.int32).at[target].add(count, mode="drop")  # [S]
    last = emitted[jnp.arange(g), jnp.maximum(count - 1, 0)]  # [G]
    emitted_on = j < count[:, None]  # [G, K1]
    counts = state.output_counts.at[jnp.where(emitted_on, target[:, None], s), emitted].add(
        1, mode="drop"
    )
    new_state = state.replace(
        cache=cache,
        draft_cache=draft_cache,
        page_tables=page_tables,
        tokens=state.tokens.at[target].set(last, mode="drop"),
        seq_lens=state.seq_lens + advance,
        num_generated=state.num_generated + advance,
        output_counts=counts,
    )
    per_slot = lambda a: jnp.zeros((s, *a.shape[1:]), a.dtype).at[target].set(a, mode="drop")
    want = batch.want_top_logprobs[gs_c] & live
    top = sampled_top_logprobs(logits[:, 0], emitted[:, 0], want)  # [G] rows
    out = StepOutput(
        tokens=per_slot(emitted[:, 0]),
        sampled=per_slot(live),
        logprobs=per_slot(logprobs[:, 0]),
        top=jax.tree.map(per_slot, top),
        prompt_top=TopLogprobs.zeros(0),
    )
    return new_state, out, SpecOutput(emitted, logprobs, count, num_drafts)


def group_live(state: EngineState, batch: SpecBatch, used: Int32[Array, " groups"]):
    """Groups that decode in the next step of the dispatch: a real slot that decodes (the
    decode rule: its token budget and the pool) and has pages left for a token (``used`` of
    its ``max_drafts`` + 1)."""
    s = state.max_slots
    gs = batch.group_slots
    return (gs < s) & state.decode_mask[jnp.clip(gs, 0, s - 1)] & (used <= batch.max_drafts)


def lookup_drafts(
    state: EngineState,
    gs_c: Int32[Array, " groups"],
    cap: Int32[Array, " groups"],
    k: int,
    stream: tuple[Int32[Array, "groups t"], Int32[Array, " groups"]] | None,
    ngram: tuple[int, int],
) -> tuple[Int32[Array, "groups k"], Int32[Array, " groups"]]:
    """Each group's proposals and how many to verify (module doc, 2): n-gram lookup over the
    group's ``stream`` (``ngram``: (min, max) n; ``ngram_device``), or all K (None: a draft
    model proposes them), at most ``cap`` and never past the request's token budget or the
    pool's length."""
    seq_lens = state.seq_lens[gs_c]  # [G]
    budget = state.max_tokens[gs_c] - state.num_generated[gs_c] - 1  # [G]
    room = state.page_tables.shape[1] * state.cache.page_size - seq_lens - 1  # [G]
    cap = jnp.maximum(jnp.minimum(cap, jnp.minimum(budget, room)), 0)
    if stream is None:
        return jnp.zeros((gs_c.shape[0], k), jnp.int32), cap
    return ngram_device.propose(*stream, cap, k, *ngram)


def ngram_stream(
    state: EngineState, batch: SpecBatch, gs_c: Int32[Array, " groups"]
) -> tuple[Int32[Array, "groups t"], Int32[Array, " groups"]]:
    """Each group's stream at the start of a dispatch (module doc, 2): the host's window, the
    tokens the dispatch in flight emitted past the host's anchor (kept in ``spec_emitted``),
    the slot's last token; and its length."""
    emitted = state.seq_lens[gs_c] - batch.anchor - 1
    return ngram_device.assemble(
        batch.window, batch.window_len, state.spec_emitted[gs_c], emitted, state.tokens[gs_c]
    )


def pack_spec(out: StepOutput, spec: SpecOutput) -> Int32[Array, " n"]:
    """The speculative extras (tokens, logprob bits, counts, proposals verified), then
    ``out.packed()``."""
    bits = jax.lax.bitcast_convert_type(spec.logprobs.astype(jnp.float32), jnp.int32)
    extras = [spec.tokens.ravel(), bits.ravel(), spec.count, spec.num_drafts]
    return jnp.concatenate([*extras, out.packed()])


def unpack_spec(packed: np.ndarray, groups: int, k1: int):
    """Host side of :func:`pack_spec`: ((tokens [G, K1], logprobs [G, K1], counts [G],
    proposals verified [G]), the ordinary packed result)."""
    n = groups * k1
    tokens = packed[:n].reshape(groups, k1)
    logprobs = packed[n : 2 * n].view(np.float32).reshape(groups, k1)
    counts = packed[2 * n : 2 * n + groups]
    num_drafts = packed[2 * n + groups : 2 * n + 2 * groups]
    return (tokens, logprobs, counts, num_drafts), packed[2 * n + 2 * groups :]
