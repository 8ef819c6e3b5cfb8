"""The jit-able device API: ``insert``, ``step``, ``release`` over an :class:`EngineState`.

All three are pure functions of (params, state, small fixed-shape inputs). ``EngineCore`` wraps
them in ``jax.jit`` with the state donated, so the KV pool is updated in place; users may also call
the pure functions inside their own ``jax.jit`` / ``lax.scan`` (see ``tests/test_engine_core.py``).

One step:
1. apply page-table writes (pages the host allocated for this step);
2. build the token buffer: one decode row per slot in ``batch.decode_slots`` (a decode bucket;
   the slot decodes its last token at position ``seq_lens[slot]`` if ``decode_mask[slot]``)
   followed by the prompt-chunk rows from the host;
3. run the model, scattering K/V into the pool and attending through the page tables;
4. sample one token for every slot that decoded or finished its prompt this step;
5. advance lengths, counters, and penalty statistics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int32

from jbatch.engine import buckets, swap
from jbatch.engine.config import EngineConfig
from jbatch.engine.sampler import SlotSampling, sample
from jbatch.engine.state import EngineState, init_state
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

    @classmethod
    def empty(cls, cfg: EngineConfig, rows: int = 0, decode_rows: int | None = None) -> StepBatch:
        """A batch with ``rows`` padding chunk rows and no page writes. ``decode_rows`` =
        ``max_slots`` (the default) lists every slot, so each slot whose ``decode_mask`` holds
        decodes; a smaller decode bucket starts with only padding (fill ``decode_slots``)."""
        w, s = buckets.max_page_writes(cfg), cfg.max_slots
        decode_rows = s if decode_rows is None else decode_rows
        if decode_rows not in buckets.decode_buckets(cfg):
            raise ValueError(
                f"decode_rows={decode_rows} is not a decode bucket {buckets.decode_buckets(cfg)}"
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
        )


def prompt_batch(cfg: EngineConfig, slot: int, token_ids, pages) -> StepBatch:
    """A step batch that prefills one whole prompt into ``slot`` and assigns it ``pages``
    (a convenience for driving the device API by hand; the scheduler builds batches itself)."""
    n = len(token_ids)
    rows = buckets.pick_bucket(cfg, -(-n // cfg.block_q) * cfg.block_q)
    if len(pages) > buckets.max_page_writes(cfg):
        raise ValueError(f"{len(pages)} pages exceed one step's {buckets.max_page_writes(cfg)}")
    batch = StepBatch.empty(cfg, rows)
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


def insert(state: EngineState, ins: SlotInsert) -> EngineState:
    """Start new sequences in the masked slots: reset their rows, set their parameters."""
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
        prompt_mask=pick(False, state.prompt_mask),
        output_counts=pick(0, state.output_counts),
    )


def release(state: EngineState, mask: Bool[Array, " slots"]) -> EngineState:
    """Retire the masked slots; they stop decoding at once (their pages belong to the host)."""
    return state.replace(active=state.active & ~mask)


def step(
    params: dict,
    state: EngineState,
    batch: StepBatch,
    *,
    model_cfg: ModelConfig,
    block_q: int,
    attn_impl: str = "auto",
    logits_shardings: tuple[jax.sharding.Sharding, ...] = (),
    attention=None,
) -> tuple[EngineState, StepOutput]:
    """One model pass over decode rows + prompt-chunk rows, then sampling (see module doc).

    ``attention`` replaces the model's attention call (tensor parallelism: per shard);
    ``logits_shardings`` (tensor parallelism): constrain the logits to each in turn — vocab-split
    as the LM head makes them, then replicated — so only ``[slots, vocab]`` logits are gathered
    (never the LM head) and the sampler runs whole rows on every shard."""
    s = state.max_slots
    slot_ids = jnp.arange(s, dtype=jnp.int32)
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
    )

    # Penalty statistics: prompt rows mark the prompt mask, re-fed outputs (resume) count.
    vocab = state.prompt_mask.shape[1]
    tok = jnp.clip(batch.prefill_tokens, 0, vocab - 1)
    is_prompt = p_valid & (p_pos < state.prompt_lens[p_slot])
    prompt_mask = state.prompt_mask.at[jnp.where(is_prompt, p_slot, s), tok].set(True, mode="drop")
    counts = state.output_counts.at[jnp.where(p_valid & ~is_prompt, p_slot, s), tok].add(
        1, mode="drop"
    )

    # The LM head runs on the decode rows plus one row per prompt block (its completing token,
    # if any: a block belongs to one sequence); each slot then picks its row of those logits.
    completes = p_valid & (p_pos == state.prefill_lens[p_slot] - 1)  # [R]
    nb = p_pos.shape[0] // block_q
    block_done = completes.reshape(nb, block_q)  # [NB, Bq]
    block_row = bd + block_q * jnp.arange(nb) + jnp.argmax(block_done, axis=1)  # [NB]
    head_rows = jnp.concatenate([jnp.arange(bd), block_row]).astype(jnp.int32)  # [Bd + NB]
    slot_row = jnp.zeros(s, jnp.int32).at[ds].set(jnp.arange(bd, dtype=jnp.int32), mode="drop")
    done_slot = jnp.where(block_done.any(axis=1), p_slot[block_q * jnp.arange(nb)], s)  # [NB]
    slot_row = slot_row.at[done_slot].set(bd + jnp.arange(nb, dtype=jnp.int32), mode="drop")
    sampled = decode.at[done_slot].set(True, mode="drop")
    logits = compute_logits(params, hidden[head_rows])[slot_row]  # [S, V]
    for sharding in logits_shardings:
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    new_tok, logprobs = sample(logits, state.sampling, state.num_generated, prompt_mask, counts)

    seq_lens = jnp.where(decode, state.seq_lens + 1, state.seq_lens)
    seq_lens = seq_lens.at[jnp.where(p_valid, p_slot, s)].max(p_pos + 1, mode="drop")
    counts = counts.at[jnp.where(sampled, slot_ids, s), new_tok].add(1, mode="drop")
    new_state = state.replace(
        cache=cache,
        page_tables=page_tables,
        tokens=jnp.where(sampled, new_tok, state.tokens),
        seq_lens=seq_lens,
        num_generated=state.num_generated + sampled,
        prompt_mask=prompt_mask,
        output_counts=counts,
    )
    return new_state, StepOutput(tokens=new_tok, sampled=sampled, logprobs=logprobs)


@dataclasses.dataclass
class EngineCore:
    """The device functions jitted once for one (model, engine config), state donated.

    With a ``mesh`` (a ``(1, tp)`` mesh of :mod:`jbatch.parallel`) the same functions are jitted
    with explicit in/out shardings: the KV pool split over KV heads, every other state field and
    every host input replicated; params (placed as :func:`jbatch.parallel.sharding.param_specs`
    says) keep their own shardings. XLA's
    SPMD partitioner splits the matmuls; attention runs per shard under ``shard_map``
    (:mod:`jbatch.parallel.attention`). ``model_cfg`` is then the sharded model's config (KV
    heads replicated when ``tp`` exceeds them).
    """

    model_cfg: ModelConfig
    cfg: EngineConfig
    mesh: Mesh | None = None

    def __post_init__(self):
        step_fn = functools.partial(
            step, model_cfg=self.model_cfg, block_q=self.cfg.block_q, attn_impl=self.cfg.attn_impl
        )
        self.host = jax.devices("cpu")[0]
        if self.mesh is not None:
            self._jit_sharded(step_fn)
            return
        self.step = jax.jit(step_fn, donate_argnums=1)
        self.insert = jax.jit(insert, donate_argnums=0)
        self.release = jax.jit(release, donate_argnums=0)
        self.swap_out = jax.jit(swap.swap_out, donate_argnums=0)
        self.swap_in = jax.jit(swap.swap_in, donate_argnums=0)
        # The state lives committed on one device, so every program sees the same placement
        # (a placement change would be a new cache key: a recompile). Swapped-out sequences
        # wait in host RAM.
        self.device = jax.devices()[0]
        self._init = lambda: jax.device_put(init_state(self.model_cfg, self.cfg), self.device)
        self.swapped_sharding = self.device

    def _jit_sharded(self, step_fn) -> None:
        from jbatch.checkpoint import expected_param_shapes
        from jbatch.parallel.attention import sharded_attention
        from jbatch.parallel.sharding import param_shardings, replicated, state_shardings

        mesh, rep = self.mesh, replicated(self.mesh)
        self.device = rep
        init = functools.partial(init_state, self.model_cfg, self.cfg)
        st = state_shardings(mesh, jax.eval_shape(init))
        pages = self.unused_pages()
        saved = state_shardings(mesh, jax.eval_shape(lambda: swap.swap_out(init(), 0, pages)[1]))
        self.param_shardings = param_shardings(mesh, expected_param_shapes(self.model_cfg))
        self.state_shardings, self.swapped_sharding = st, saved
        head = self.param_shardings.get("lm_head", self.param_shardings["embed"])
        vocab_split = NamedSharding(mesh, P(None, *head.spec[:1]))  # the logits' [S, V] split
        self._init = jax.jit(init, out_shardings=st)
        self.step = jax.jit(
            functools.partial(
                step_fn, logits_shardings=(vocab_split, rep), attention=sharded_attention(mesh)
            ),
            # Params keep the shardings they were placed with (``param_specs``; whatever their
            # layout), the state and every host input are pinned.
            in_shardings=(None, st, rep),
            out_shardings=(st, rep),
            donate_argnums=1,
        )
        self.insert = jax.jit(insert, in_shardings=(st, rep), out_shardings=st, donate_argnums=0)
        self.release = jax.jit(release, in_shardings=(st, rep), out_shardings=st, donate_argnums=0)
        self.swap_out = jax.jit(
            swap.swap_out, in_shardings=(st, rep, rep), out_shardings=(st, saved), donate_argnums=0
        )
        self.swap_in = jax.jit(
            swap.swap_in, in_shardings=(st, rep, rep, saved), out_shardings=st, donate_argnums=0
        )
        if jax.process_count() > 1:  # the host reads its own copy of the replicated outputs
            sharded_step = self.step
            local = lambda a: a.addressable_shards[0].data
            self.step = lambda *args: _map_second(sharded_step(*args), local)

    def unused_pages(self) -> np.ndarray:
        """A page list of only padding (``num_pages``), the shape swap functions take."""
        return np.full(self.cfg.max_pages_per_seq, self.cfg.num_pages, np.int32)

    def init_state(self) -> EngineState:
        return self._init()

    def to_host(self, saved: swap.SwappedSlot) -> swap.SwappedSlot:
        if self.mesh is not None:  # each local shard to host RAM (no gather, no compile)
            return jax.tree.map(_HostShards.of, saved)
        return saved if self.host == self.device else jax.device_put(saved, self.host)

    def to_device(self, saved: swap.SwappedSlot) -> swap.SwappedSlot:
        if self.mesh is not None:
            return jax.tree.map(lambda h, s: h.to_device(s), saved, self.swapped_sharding)
        return jax.device_put(saved, self.device)

    def empty_insert(self) -> SlotInsert:
        return build_empty_insert(self.cfg)

    def warmup(self, params: dict, state: EngineState) -> EngineState:
        """Compile every program the engine will ever run (one ``step`` per bucket pair)."""
        state = self.insert(state, self.empty_insert())
        state = self.release(state, np.zeros(self.cfg.max_slots, bool))
        if self.cfg.preemption_mode != "recompute":
            state, saved = self.swap_out(state, np.int32(0), self.unused_pages())
            saved = self.to_device(self.to_host(saved))  # the round trip a swap makes
            state = self.swap_in(state, np.int32(0), self.unused_pages(), saved)
            state = self.release(state, np.ones(self.cfg.max_slots, bool))
        for rows in buckets.prefill_buckets(self.cfg):
            for decode_rows in buckets.decode_buckets(self.cfg):
                batch = StepBatch.empty(self.cfg, rows, decode_rows)
                state, out = self.step(params, state, batch)
        jax.block_until_ready(out)
        return state


def _map_second(pair, fn):
    first, second = pair
    return first, jax.tree.map(fn, second)


@dataclasses.dataclass
class _HostShards:
    """A sharded array's process-local shards in host RAM (one swapped-out KV buffer or row)."""

    shape: tuple[int, ...]
    shards: list[tuple[jax.Device, np.ndarray]]

    @classmethod
    def of(cls, a: jax.Array) -> _HostShards:
        return cls(a.shape, [(s.device, np.asarray(s.data)) for s in a.addressable_shards])

    def to_device(self, sharding: NamedSharding) -> jax.Array:
        bufs = [jax.device_put(x, d) for d, x in self.shards]
        return jax.make_array_from_single_device_arrays(self.shape, sharding, bufs)
