"""Turns a SchedulerOutput into the fixed-shape numpy inputs of ``insert`` / ``step``."""

from __future__ import annotations

import numpy as np

from jbatch.engine import buckets
from jbatch.engine.config import EngineConfig
from jbatch.engine.core import SlotInsert, StepBatch
from jbatch.engine.request import Request
from jbatch.engine.sampler import SlotSampling
from jbatch.engine.scheduler import SchedulerOutput


def release_mask(cfg: EngineConfig, slots: list[int]) -> np.ndarray:
    mask = np.zeros(cfg.max_slots, bool)
    mask[slots] = True
    return mask


def build_insert(cfg: EngineConfig, seqs: list[Request]) -> SlotInsert:
    s = cfg.max_slots
    i32 = lambda: np.zeros(s, np.int32)
    f32 = lambda v: np.full(s, v, np.float32)
    mask, prefill, prompt, generated, max_tokens = np.zeros(s, bool), i32(), i32(), i32(), i32()
    tables, seq_lens = np.full((s, cfg.max_pages_per_seq), cfg.num_pages, np.int32), i32()
    temperature, top_k, top_p, min_p = f32(0.0), i32(), f32(1.0), f32(0.0)
    rep, presence, freq, seed = f32(1.0), f32(0.0), f32(0.0), np.zeros(s, np.uint32)
    for seq in seqs:
        i, p = seq.slot, seq.params
        mask[i] = True
        # Prefix-cache hits: their pages and length. Pages for the first chunk come as writes.
        cached = seq.num_cached_tokens // cfg.page_size
        tables[i, :cached] = seq.pages[:cached]
        seq_lens[i] = seq.num_cached_tokens
        prefill[i], prompt[i] = len(seq.prefill_ids), len(seq.prompt_ids)
        # Outputs so far (all processed: a sequence is admitted with nothing in flight).
        generated[i], max_tokens[i] = len(seq.output_ids), seq.max_tokens
        temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        rep[i], presence[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        seed[i] = seq.seed
    sampling = SlotSampling(temperature, top_k, top_p, min_p, rep, presence, freq, seed)
    return SlotInsert(mask, tables, seq_lens, prefill, prompt, generated, max_tokens, sampling)


def build_step(cfg: EngineConfig, out: SchedulerOutput) -> StepBatch:
    rows = buckets.pick_bucket(cfg, out.prompt_rows)
    batch = StepBatch.empty(cfg, rows, buckets.pick_decode_bucket(cfg, len(out.decodes)))
    batch.decode_slots[:] = cfg.max_slots  # padding; the decoding slots first
    batch.decode_slots[: len(out.decodes)] = [seq.slot for seq in out.decodes]
    r = 0
    for chunk in out.chunks:
        n = len(chunk.token_ids)
        batch.prefill_tokens[r : r + n] = chunk.token_ids
        batch.prefill_slots[r : -(-(r + n) // cfg.block_q) * cfg.block_q] = chunk.seq.slot
        batch.prefill_positions[r : r + n] = np.arange(chunk.start, chunk.start + n)
        r += -(-n // cfg.block_q) * cfg.block_q
    for j, (slot, index, page) in enumerate(out.page_writes):
        batch.write_slots[j], batch.write_index[j], batch.write_pages[j] = slot, index, page
    return batch
