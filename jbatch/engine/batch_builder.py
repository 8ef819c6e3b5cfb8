"""Writes a SchedulerOutput into the packed, fixed-shape input of the one step program."""

from __future__ import annotations

from collections.abc import Iterator

from jbatch.engine import buckets, logprob_host, stop_checker
from jbatch.engine.config import EngineConfig
from jbatch.engine.request import Request
from jbatch.engine.scheduler_output import Chunk, SchedulerOutput
from jbatch.engine.step_input import StepInput


def build_step_input(cfg: EngineConfig, core, sched: SchedulerOutput) -> StepInput:
    """The step's input from ``core.new_input`` (buffers holding the defaults), filled in:
    slots to release, requests to insert, decode slots, prompt-chunk rows, page writes."""
    # An admission block's later steps decode its new requests too: every slot is listed.
    decoding = cfg.max_slots if sched.admission_block else len(sched.decodes)
    pair = buckets.pick_pair(cfg, sched.prompt_rows, decoding, sched.prompt_tokens)
    inp = core.new_input(*pair)
    inp.release[sched.releases] = True
    for seq in sched.inserts:
        _fill_insert(cfg, inp.insert, seq)
    _fill_step(cfg, inp.batch, sched)
    inp.batch.decode_steps[0] = sched.steps  # a block of decode steps (decode-only programs)
    if sched.idle_budget is not None:  # it may end early on stop tokens (decode_block.py)
        _fill_block_stops(inp.batch, sched)
    logprob_host.fill_step(inp.batch, sched, chunk_rows(sched.chunks, cfg.block_q))
    return inp


def build_spec_input(cfg: EngineConfig, core, sched: SchedulerOutput) -> StepInput:
    """The input of a speculative step (``spec_step.py``): one group per decode, in the order
    of ``sched.decodes``, with its proposal; releases, inserts and page writes as above."""
    groups = buckets.pick_spec_bucket(cfg, len(sched.decodes))
    inp = core.new_spec_input(groups)
    inp.release[sched.releases] = True
    for seq in sched.inserts:
        _fill_insert(cfg, inp.insert, seq)
    batch = inp.batch
    batch.steps[0] = sched.steps
    for g, (seq, proposal) in enumerate(zip(sched.decodes, sched.drafts)):
        batch.group_slots[g] = seq.slot
        if proposal is not None:
            n = min(len(proposal.tokens), batch.window.shape[1])  # the latest tokens
            batch.max_drafts[g], batch.anchor[g] = proposal.cap, proposal.anchor
            batch.propose[g] = proposal.speculates
            batch.window_len[g] = n
            if n:
                batch.window[g, :n] = proposal.tokens[len(proposal.tokens) - n :]
        if seq.params.logprobs is not None:
            batch.want_top_logprobs[seq.slot] = True
    _fill_page_writes(batch, sched)
    return inp


def _fill_insert(cfg: EngineConfig, ins, seq: Request) -> None:
    """Row ``seq.slot`` of the SlotInsert views."""
    i, p = seq.slot, seq.params
    ins.mask[i] = True
    # Prefix-cache hits: their pages and length. Pages for the first chunk come as writes.
    cached = seq.num_cached_tokens // cfg.page_size
    ins.page_tables[i, :cached] = seq.pages[:cached]
    ins.seq_lens[i] = seq.num_cached_tokens
    ins.prefill_lens[i], ins.prompt_lens[i] = len(seq.prefill_ids), len(seq.prompt_ids)
    # Outputs so far (all processed: a request is admitted with nothing in flight).
    ins.num_generated[i], ins.max_tokens[i] = len(seq.output_ids), seq.max_tokens
    sp = ins.sampling
    sp.temperature[i], sp.top_k[i], sp.top_p[i], sp.min_p[i] = (
        p.temperature, p.top_k, p.top_p, p.min_p
    )  # fmt: skip
    sp.repetition_penalty[i] = p.repetition_penalty
    sp.presence_penalty[i], sp.frequency_penalty[i] = p.presence_penalty, p.frequency_penalty
    sp.seed[i] = seq.seed


def _fill_step(cfg: EngineConfig, batch, sched: SchedulerOutput) -> None:
    """Decode slots (compacted, padding after), prompt-chunk rows (each chunk starts a new
    ``block_q`` block, so a block never holds two sequences), page writes."""
    if sched.steps > 1:  # a block: each request that samples (an admission's new ones too)
        listed = [slot for _, slot in sched.samplers]
    else:
        listed = [seq.slot for seq in sched.decodes]
    batch.decode_slots[: len(listed)] = listed
    bq = cfg.block_q
    for chunk, r in chunk_rows(sched.chunks, bq):
        n = len(chunk.token_ids)
        batch.prefill_tokens[r : r + n] = chunk.token_ids
        batch.prefill_slots[r : -(-(r + n) // bq) * bq] = chunk.seq.slot
        batch.prefill_positions[r : r + n] = range(chunk.start, chunk.start + n)
    _fill_page_writes(batch, sched)


def _fill_page_writes(batch, sched: SchedulerOutput) -> None:
    if sched.page_writes:
        slots, index, pages = zip(*sched.page_writes)
        w = len(slots)
        batch.write_slots[:w], batch.write_index[:w], batch.write_pages[:w] = slots, index, pages


def _fill_block_stops(batch, sched: SchedulerOutput) -> None:
    """Each decoding slot's first ``BLOCK_STOP_TOKENS`` stop token ids, and the block's idle
    budget."""
    batch.block_idle_budget[0] = sched.idle_budget
    for seq, slot in sched.samplers:
        ids = stop_checker.stop_token_ids(seq)[: buckets.BLOCK_STOP_TOKENS]
        batch.block_stop_tokens[slot, : len(ids)] = ids


def chunk_rows(chunks: list[Chunk], block_q: int) -> Iterator[tuple[Chunk, int]]:
    """Each prompt chunk with its first row: chunks follow each other, each from a new block."""
    r = 0
    for chunk in chunks:
        yield chunk, r
        r += -(-len(chunk.token_ids) // block_q) * block_q
