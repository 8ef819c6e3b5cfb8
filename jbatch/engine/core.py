"""The jit-able device API: ``insert``, ``step``, ``release`` over an :class:`EngineState`.

All three are pure functions of (params, state, small fixed-shape inputs); ``engine_step``
chains them (release, insert, step) into what the engine runs as one program per step.
``EngineCore`` (``engine_core.py``) jits that with the state donated, so the KV pool is updated in
place; users may also call the pure functions inside their own ``jax.jit`` / ``lax.scan`` (see
``tests/test_engine_core.py``).

One step:
1. apply page-table writes (pages the host allocated for this step);
2. build the token buffer: one decode row per slot in ``batch.decode_slots`` (a decode bucket;
   the slot decodes its last token at position ``seq_lens[slot]`` if ``decode_mask[slot]``)
   followed by the prompt-chunk rows from the host;
3. run the model, scattering K/V into the pool and attending through the page tables;
4. sample one token for every slot that decoded or finished its prompt this step;
5. advance lengths, counters, and penalty statistics.

``decode_block.py`` runs several decode-only steps in one program (``EngineConfig.decode_steps``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int32, Shaped

from jbatch.engine import buckets, sampling_rows
from jbatch.engine.config import EngineConfig
from jbatch.engine.draft_proposer import step_draft_cache
from jbatch.engine.logprobs import TopLogprobs, pack, prompt_top_logprobs, sampled_top_logprobs
from jbatch.engine.logprobs import unpack as unpack_logprobs
from jbatch.engine.sampler import SlotSampling, sample
from jbatch.engine.state import EngineState
from jbatch.models.config import ModelConfig
from jbatch.models.llama import compute_logits, forward


@struct.dataclass
class SlotInsert:
    """New sequences for the slots where ``mask`` is set (other rows are ignored)."""

    mask: Bool[Array, " slots"]
    page_tables: Int32[Array, "slots max_pages"]  # initial rows: prefix-cache hits, else unset
    seq_lens: Int32[Array, " slots"]  # tokens already in the pool (prefix-cache hits)
    prefill_lens: Int32[Array, " slots"]  # tokens to prefill (prompt, plus outputs on resume)
    prompt_lens: Int32[Array, " slots"]
    num_generated: Int32[Array, " slots"]  # > 0 when resuming a preempted sequence
    max_tokens: Int32[Array, " slots"]
    sampling: SlotSampling


def build_empty_insert(cfg: EngineConfig) -> SlotInsert:
    """A SlotInsert that inserts nothing (all rows masked off)."""
    s = cfg.max_slots
    z = lambda: np.zeros(s, np.int32)
    return SlotInsert(
        mask=np.zeros(s, bool),
        page_tables=np.full((s, cfg.max_pages_per_seq), cfg.num_pages, np.int32),
        seq_lens=z(),
        prefill_lens=z(),
        prompt_lens=z(),
        num_generated=z(),
        max_tokens=z(),
        sampling=SlotSampling.neutral(s),
    )


@struct.dataclass
class StepBatch:
    """Host inputs of one step. ``rows`` (a bucket) prompt-chunk rows; padding has position -1.
    Page writes set ``page_tables[write_slots, write_index] = write_pages``; padding entries use
    slot ``max_slots`` (out of bounds, dropped)."""

    prefill_tokens: Int32[Array, " rows"]
    prefill_slots: Int32[Array, " rows"]
    prefill_positions: Int32[Array, " rows"]
    write_slots: Int32[Array, " writes"]
    write_index: Int32[Array, " writes"]
    write_pages: Int32[Array, " writes"]
    # Slots that may decode this step, padded with ``max_slots``; a slot decodes iff it is
    # listed here and ``decode_mask`` holds for it. Its length is a decode bucket.
    decode_slots: Int32[Array, " decode_rows"]
    # Logprobs (``logprobs.py``): slots whose sampled token's top-k is wanted, and per prompt
    # row the next prompt token whose logprob is wanted (-1: none).
    want_top_logprobs: Bool[Array, " slots"]
    prefill_targets: Int32[Array, " rows"]
    # A decode-only step of an engine with ``decode_steps`` > 1: how many decode steps its
    # block runs (``decode_block``); other steps run one.
    decode_steps: Int32[Array, " 1"]
    # A block that may end early (``decode_block``): each decoding slot's stop token ids (-1:
    # none), and the slot-steps it may leave idle behind slots that sampled one before it
    # ends (``buckets.NO_EARLY_END``: it runs its whole count).
    block_stop_tokens: Int32[Array, "slots stops"]
    block_idle_budget: Int32[Array, " 1"]

    @classmethod
    def empty(cls, cfg: EngineConfig, rows: int = 0, decode_rows: int | None = None) -> StepBatch:
        """A batch with ``rows`` padding chunk rows and no page writes. ``decode_rows`` =
        ``max_slots`` (the default) lists every slot, so each slot whose ``decode_mask`` holds
        decodes; a smaller decode bucket starts with only padding (fill ``decode_slots``)."""
        w, s = buckets.max_page_writes(cfg), cfg.max_slots
        decode_rows = s if decode_rows is None else decode_rows
        allowed = buckets.decode_buckets(cfg, rows)
        if decode_rows not in allowed:
            raise ValueError(
                f"decode_rows={decode_rows} is not a decode bucket {allowed} of {rows} prompt rows"
            )
        decode_slots = np.arange(s, dtype=np.int32) if decode_rows == s else np.full(decode_rows, s)
        return cls(
            prefill_tokens=np.zeros(rows, np.int32),
            prefill_slots=np.zeros(rows, np.int32),
            prefill_positions=np.full(rows, -1, np.int32),
            write_slots=np.full(w, cfg.max_slots, np.int32),
            write_index=np.zeros(w, np.int32),
            write_pages=np.zeros(w, np.int32),
            decode_slots=decode_slots.astype(np.int32),
            want_top_logprobs=np.zeros(s, bool),
            prefill_targets=np.full(rows, -1, np.int32),
            decode_steps=np.ones(1, np.int32),
            block_stop_tokens=np.full((s, buckets.BLOCK_STOP_TOKENS), -1, np.int32),
            block_idle_budget=np.full(1, buckets.NO_EARLY_END, np.int32),
        )


def prompt_batch(cfg: EngineConfig, slot: int, token_ids, pages) -> StepBatch:
    """A step batch that prefills one whole prompt into ``slot`` and assigns it ``pages``
    (a convenience for driving the device API by hand; the scheduler builds batches itself)."""
    n = len(token_ids)
    rows = buckets.pick_bucket(cfg, buckets.block_rows(cfg, n), n)
    if len(pages) > buckets.max_page_writes(cfg):
        raise ValueError(f"{len(pages)} pages exceed one step's {buckets.max_page_writes(cfg)}")
    batch = StepBatch.empty(cfg, rows, buckets.decode_buckets(cfg, rows)[-1])  # every slot
    batch.prefill_tokens[:n] = token_ids
    batch.prefill_slots[:] = slot
    batch.prefill_positions[:n] = np.arange(n)
    batch.write_slots[: len(pages)] = slot
    batch.write_index[: len(pages)] = np.arange(len(pages))
    batch.write_pages[: len(pages)] = pages
    return batch


def insert_one(
    cfg: EngineConfig,
    slot: int,
    prompt_len: int,
    max_tokens: int,
    sampling: SlotSampling | None = None,
) -> SlotInsert:
    """A SlotInsert that starts one sequence in ``slot`` (greedy unless ``sampling`` is given;
    ``sampling`` holds all slots' rows, only ``slot``'s is used)."""
    s = cfg.max_slots
    col = lambda v: np.where(np.arange(s) == slot, v, 0).astype(np.int32)
    return SlotInsert(
        mask=np.arange(s) == slot,
        page_tables=np.full((s, cfg.max_pages_per_seq), cfg.num_pages, np.int32),
        seq_lens=col(0),
        prefill_lens=col(prompt_len),
        prompt_lens=col(prompt_len),
        num_generated=col(0),
        max_tokens=col(max_tokens),
        sampling=SlotSampling.neutral(s) if sampling is None else sampling,
    )


@struct.dataclass
class StepOutput:
    tokens: Int32[Array, " slots"]  # sampled token per slot (valid where sampled)
    sampled: Bool[Array, " slots"]
    logprobs: Float[Array, " slots"]  # log-probability of the sampled token (raw model)
    top: TopLogprobs  # per slot: the sampled token's rank and the top-k (``logprobs.py``)
    prompt_top: TopLogprobs  # per prompt row: its target's logprob, rank and the top-k

    def packed(self) -> Int32[Array, " n"]:
        """Everything in one flat int32 array (one device-to-host copy): tokens, sampled,
        logprob bits, then the top logprobs; :func:`unpack_output` reads it on the host."""
        bits = jax.lax.bitcast_convert_type(self.logprobs.astype(jnp.float32), jnp.int32)
        head = jnp.stack([self.tokens, self.sampled.astype(jnp.int32), bits])
        return pack(head, self.top, self.prompt_top)


def unpack_output(packed: np.ndarray, slots: int):
    """Host side of :meth:`StepOutput.packed`: (tokens [S], sampled [S], logprobs [S], top
    logprobs per slot, top logprobs per prompt row) — numpy views."""
    head, top, prompt_top = unpack_logprobs(packed, slots)
    return head[0], head[1].astype(bool), head[2].view(np.float32), top, prompt_top


def insert(state: EngineState, ins: SlotInsert) -> EngineState:
    """Start new sequences in the masked slots: reset their rows, set their parameters.

    Per-slot rows are selected with ``where`` (O(slots)); the vocab-wide penalty rows are
    zeroed only for the inserted slots (O(inserted x vocab): nothing when none is inserted)."""
    m = ins.mask
    pick = lambda new, old: jnp.where(m.reshape(m.shape + (1,) * (old.ndim - 1)), new, old)
    return state.replace(
        page_tables=pick(ins.page_tables, state.page_tables),
        tokens=pick(0, state.tokens),
        seq_lens=pick(ins.seq_lens, state.seq_lens),
        prefill_lens=pick(ins.prefill_lens, state.prefill_lens),
        prompt_lens=pick(ins.prompt_lens, state.prompt_lens),
        active=state.active | m,
        num_generated=pick(ins.num_generated, state.num_generated),
        max_tokens=pick(ins.max_tokens, state.max_tokens),
        sampling=jax.tree.map(pick, ins.sampling, state.sampling),
        prompt_mask=_zero_rows(state.prompt_mask, m),
        output_counts=_zero_rows(state.output_counts, m),
    )


def _zero_rows(x: Shaped[Array, "slots vocab"], mask: Bool[Array, " slots"]):
    """``x`` with the masked rows zeroed, one row write per masked slot."""
    s = mask.shape[0]
    rows = jnp.nonzero(mask, size=s, fill_value=s)[0]  # [S] masked slots first
    zero = jnp.zeros((1, x.shape[1]), x.dtype)
    body = lambda i, x: jax.lax.dynamic_update_slice(x, zero, (rows[i], 0))
    return jax.lax.fori_loop(0, jnp.sum(mask), body, x)


def release(state: EngineState, mask: Bool[Array, " slots"]) -> EngineState:
    """Retire the masked slots; they stop decoding at once (their pages belong to the host)."""
    return state.replace(active=state.active & ~mask)


@struct.dataclass
class ForwardResult:
    """What :func:`step_forward` hands :func:`step_sample`: the step's logits and the rows that
    sample (everything sampling needs that the state does not hold)."""

    logits: Float[Array, "rows vocab"]  # the LM head on the rows that sample (float32)
    row_slots: Int32[Array, " rows"]  # each row's slot (max_slots: none; sampling_rows.py)
    sampled: Bool[Array, " slots"]  # slots that sample this step
    want_top: Bool[Array, " slots"]  # slots that asked for top logprobs
    prompt_top: TopLogprobs  # per prompt row (computed with the forward)


def step_forward(
    params: dict,
    state: EngineState,
    batch: StepBatch,
    *,
    model_cfg: ModelConfig,
    block_q: int,
    attn_impl: str = "auto",
    logits_shardings: tuple[jax.sharding.Sharding, ...] = (),
    attention=None,
    experts=None,
    draft_cfg: ModelConfig | None = None,
    packed_rows: int | None = None,
) -> tuple[EngineState, ForwardResult]:
    """Steps 1-3 of the module doc and the lengths of step 5: everything of a step that does
    not depend on the tokens it samples (``attention``, ``experts``, ``logits_shardings``: see
    :func:`step`; ``draft_cfg``: a draft model runs over the same token buffer, its params are
    ``params["draft"]``, ``draft_proposer.step_draft_cache``; ``packed_rows``: the layers
    compute the prompt chunks' tokens packed into that many rows, ``llama.forward``)."""
    s = state.max_slots
    page_tables = state.page_tables.at[batch.write_slots, batch.write_index].set(
        batch.write_pages, mode="drop"
    )
    ds = batch.decode_slots  # [Bd] decode rows' slots, padding = S
    bd = ds.shape[0]
    ds_c = jnp.clip(ds, 0, s - 1)  # [Bd]
    listed = jnp.zeros(s, bool).at[ds].set(True, mode="drop")  # [S]
    decode = state.decode_mask & listed  # [S]
    row_decodes = (ds < s) & decode[ds_c]  # [Bd]
    p_pos, p_slot = batch.prefill_positions, batch.prefill_slots  # [R]
    p_valid = p_pos >= 0
    tokens = jnp.concatenate([state.tokens[ds_c], batch.prefill_tokens])  # [Bd + R]
    positions = jnp.concatenate([jnp.where(row_decodes, state.seq_lens[ds_c], -1), p_pos])
    slots = jnp.concatenate([ds_c, p_slot])
    hidden, cache = forward(
        params,
        model_cfg,
        state.cache,
        tokens,
        positions,
        slots,
        page_tables,
        num_decode=bd,
        block_q=block_q,
        attn_impl=attn_impl,
        attention=attention,
        experts=experts,
        packed_rows=packed_rows,
    )
    draft_cache = step_draft_cache(
        params, draft_cfg, state, tokens, positions, slots, page_tables,
        num_decode=bd, block_q=block_q, attn_impl=attn_impl,
    )  # fmt: skip

    # Penalty statistics: prompt rows mark the prompt mask, re-fed outputs (resume) count.
    vocab = state.prompt_mask.shape[1]
    tok = jnp.clip(batch.prefill_tokens, 0, vocab - 1)
    is_prompt = p_valid & (p_pos < state.prompt_lens[p_slot])
    prompt_mask = state.prompt_mask.at[jnp.where(is_prompt, p_slot, s), tok].set(True, mode="drop")
    counts = state.output_counts.at[jnp.where(p_valid & ~is_prompt, p_slot, s), tok].add(
        1, mode="drop"
    )

    # The LM head and the sampler run on the decode rows plus one row per prompt block (its
    # completing token, if any: a block belongs to one sequence), each row tagged with the slot
    # it samples for (sampling_rows.py).
    completes = p_valid & (p_pos == state.prefill_lens[p_slot] - 1)  # [R]
    nb = p_pos.shape[0] // block_q
    block_done = completes.reshape(nb, block_q)  # [NB, Bq]
    block_row = bd + block_q * jnp.arange(nb) + jnp.argmax(block_done, axis=1)  # [NB]
    done_slot = jnp.where(block_done.any(axis=1), p_slot[block_q * jnp.arange(nb)], s)  # [NB]
    head_rows, row_slots = sampling_rows.head_rows(
        jnp.concatenate([jnp.arange(bd), block_row]).astype(jnp.int32),  # [Bd + NB]
        jnp.concatenate([jnp.where(row_decodes, ds, s), done_slot]).astype(jnp.int32),
        s,
    )  # [H], [H]
    sampled = decode.at[done_slot].set(True, mode="drop")

    def constrained(logits: Float[Array, "n vocab"]) -> Float[Array, "n vocab"]:
        for sharding in logits_shardings:
            logits = jax.lax.with_sharding_constraint(logits, sharding)
        return logits

    head = lambda h: constrained(compute_logits(params, h, model_cfg))  # [n, E] -> [n, V]
    logits = head(hidden[head_rows])  # [H, V]
    prompt_top = prompt_top_logprobs(head, hidden[bd:], batch.prefill_targets, block_q)

    seq_lens = jnp.where(decode, state.seq_lens + 1, state.seq_lens)
    seq_lens = seq_lens.at[jnp.where(p_valid, p_slot, s)].max(p_pos + 1, mode="drop")
    new_state = state.replace(
        cache=cache,
        draft_cache=draft_cache,
        page_tables=page_tables,
        seq_lens=seq_lens,
        prompt_mask=prompt_mask,
        output_counts=counts,
    )
    return new_state, ForwardResult(logits, row_slots, sampled, batch.want_top_logprobs, prompt_top)


def step_sample(
    state: EngineState,
    fwd: ForwardResult,
    token_bitmask: Int32[Array, "slots words"] | None = None,
) -> tuple[EngineState, StepOutput]:
    """Steps 4-5 of the module doc: sample one token for every slot of ``fwd.sampled``
    (``token_bitmask``: the tokens each may take), advance the counters. Sampling runs on the
    rows of ``fwd.logits`` (``sampling_rows.py``); the output has one entry per slot."""
    s, rs = state.max_slots, fwd.row_slots
    at = sampling_rows.slot_index(rs, s)  # [H]
    sp, step_index, want = sampling_rows.slot_view(
        (state.sampling, state.num_generated, fwd.want_top), at
    )
    allowed = None if token_bitmask is None else sampling_rows.slot_view(token_bitmask, at)
    new_tok, logprobs = sample(
        fwd.logits, sp, step_index, state.prompt_mask, state.output_counts, allowed, rows=at
    )
    to_slots = lambda rows: sampling_rows.to_slots(rows, rs, s)
    top = sampled_top_logprobs(fwd.logits, new_tok, want & (rs < s), to_slots, s)  # [S]
    counts = state.output_counts.at[rs, new_tok].add(1, mode="drop")
    new_state = state.replace(
        tokens=state.tokens.at[rs].set(new_tok, mode="drop"),
        num_generated=state.num_generated + fwd.sampled,
        output_counts=counts,
    )
    tokens, logprobs = to_slots((new_tok, logprobs))
    return new_state, StepOutput(tokens, fwd.sampled, logprobs, top, fwd.prompt_top)


def step(
    params: dict,
    state: EngineState,
    batch: StepBatch,
    *,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    **forward_kwargs,
) -> tuple[EngineState, StepOutput]:
    """One model pass over decode rows + prompt-chunk rows, then sampling (see module doc):
    :func:`step_forward` then :func:`step_sample`, in one program.

    ``token_bitmask``: the tokens each slot may sample (structured output; see
    ``sampler.apply_bitmask``), None or all ones: any token. ``forward_kwargs``:
    ``model_cfg``, ``block_q``, ``attn_impl``, ``packed_rows`` (a packed prompt region's dense
    rows: ``buckets.dense_rows``); ``attention`` and ``experts`` replace the model's
    attention and MoE expert calls (tensor parallelism: per shard); ``logits_shardings``
    (tensor parallelism): constrain the logits to each in turn — vocab-split as the LM head
    makes them, then replicated — so only ``[slots, vocab]`` logits are gathered (never the LM
    head) and the sampler runs whole rows on every shard."""
    state, fwd = step_forward(params, state, batch, **forward_kwargs)
    return step_sample(state, fwd, token_bitmask)


def engine_forward(
    params: dict,
    state: EngineState,
    release_mask: Bool[Array, " slots"],
    ins: SlotInsert,
    batch: StepBatch,
    **forward_kwargs,
) -> tuple[EngineState, ForwardResult]:
    """:func:`engine_step` up to the sampling: release, insert, :func:`step_forward` (its
    sampling is :func:`step_sample`, a program of its own: ``EngineConfig.structured_overlap``)."""
    return step_forward(params, insert(release(state, release_mask), ins), batch, **forward_kwargs)


def engine_step(
    params: dict,
    state: EngineState,
    release_mask: Bool[Array, " slots"],
    ins: SlotInsert,
    batch: StepBatch,
    token_bitmask: Int32[Array, "slots words"] | None = None,
    **step_kwargs,
) -> tuple[EngineState, StepOutput]:
    """Everything one engine step does on the device, in order: retire the ``release_mask``
    slots, start the ``ins`` sequences, then :func:`step` (``step_kwargs`` are its keywords;
    ``token_bitmask`` constrains sampling). ``EngineCore`` compiles this as the engine's one
    program per bucket pair."""
    state = insert(release(state, release_mask), ins)
    return step(params, state, batch, token_bitmask=token_bitmask, **step_kwargs)
