"""Handover: a request moving from a prefill engine to a decode engine (disaggregation).

A prefill engine (``EngineConfig.role == "prefill"``) copies a request out as soon as the step
with its last prompt chunk has been dispatched (``Scheduler._schedule_handovers`` and
``swap.swap_out``: its pages of every layer, 8-bit scales included, and its slot rows — lengths,
first token, RNG counter, sampling row, penalty statistics); the copy stays on the prefill
devices and the slot and pages are free for the next step. Once the step that sampled the first
token has been processed on the host, :func:`take_ready` hands the request over as a
:class:`HandoverRecord` (its host state, plain values) plus that device copy. :func:`admit`
rebuilds the request in a decode engine, starts the copy onto the decode engine's devices
(asynchronous), and queues it like a swapped-out request: the scheduler swaps it into fresh
pages of its own pool when a slot and pages are free (``Scheduler._admit_from``).
"""

from __future__ import annotations

import dataclasses
import time

from jbatch.engine import grammar
from jbatch.engine.request import Request, RequestStatus
from jbatch.engine.swap import SwappedSlot
from jbatch.outputs import OutputKind
from jbatch.sampling_params import SamplingParams
from jbatch.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass(frozen=True)
class HandoverRecord:
    """The host side of a handed-over request: what a decode engine needs to continue it (the
    device side is a ``SwappedSlot``). Clocks are sent as ages: processes do not share one."""

    request_id: str
    prompt_ids: tuple[int, ...]
    prompt: str | None
    params: SamplingParams
    max_tokens: int
    seed: int
    priority: int
    tenant: str
    output_kind: OutputKind
    output_ids: tuple[int, ...]  # the first token (sampled by the prefill engine)
    logprobs: tuple[float, ...]
    cumulative_logprob: float
    top_logprobs: tuple  # per output token (``params.logprobs`` set), else empty
    prompt_logprobs: tuple | None
    prompt_logprobs_sent: bool
    pending_text: str  # detokenized, not streamed yet (held back for stop strings)
    text_chunks: tuple[str, ...]  # streamed text kept for a FINAL output
    detokenizer: dict | None  # IncrementalDetokenizer.get_state()
    num_pages: int  # pages the device copy holds
    age_seconds: float  # since arrival
    first_token_age: float  # since the first token was read
    num_preemptions: int


def record_of(seq: Request, now: float | None = None) -> HandoverRecord:
    """The record of a handed-over request whose first token has been processed."""
    now = time.monotonic() if now is None else now
    return HandoverRecord(
        request_id=seq.request_id,
        prompt_ids=tuple(seq.prompt_ids),
        prompt=seq.prompt,
        params=seq.params,
        max_tokens=seq.max_tokens,
        seed=seq.seed,
        priority=seq.priority,
        tenant=seq.tenant,
        output_kind=seq.output_kind,
        output_ids=tuple(seq.output_ids),
        logprobs=tuple(seq.logprobs),
        cumulative_logprob=seq.cumulative_logprob,
        top_logprobs=tuple(seq.top_logprobs),
        prompt_logprobs=None if seq.prompt_logprobs is None else tuple(seq.prompt_logprobs),
        prompt_logprobs_sent=seq.prompt_logprobs_sent,
        pending_text=seq.pending_text,
        text_chunks=tuple(seq.text_chunks),
        detokenizer=None if seq.detokenizer is None else seq.detokenizer.get_state(),
        num_pages=seq.swapped_pages,
        age_seconds=now - seq.arrival_time,
        first_token_age=now - (seq.first_token_time or now),
        num_preemptions=seq.num_preemptions,
    )


def take_ready(engine) -> list[tuple[HandoverRecord, SwappedSlot]]:
    """The prefill ``engine``'s handed-over requests whose first token has been processed, with
    their device copies; the engine forgets them. Requests that finished with their first token
    (or were aborted) are dropped here (their final output came from the prefill engine)."""
    ready, waiting = [], []
    for seq in engine.handed_over:
        if seq.status is not RequestStatus.HANDED_OVER:
            seq.swapped = None  # finished by its first token, or aborted
        elif seq.inflight:
            waiting.append(seq)
        else:
            ready.append((record_of(seq), seq.swapped))
            seq.swapped = None
            engine.requests.pop(seq.request_id, None)
    engine.handed_over[:] = waiting
    return ready


def admit(engine, record: HandoverRecord, saved: SwappedSlot) -> Request:
    """Continue ``record`` in the decode ``engine``: the device copy ``saved`` (on any devices)
    is put on the engine's placement (asynchronously) and the request queued to be swapped in."""
    if engine.cfg.role != "decode":
        role = engine.cfg.role
        raise ValueError(f"handed-over requests go to a role='decode' engine, not {role!r}")
    rid = record.request_id
    if rid in engine.requests:
        raise ValueError(f"request_id {rid!r} is already in use")
    now = time.monotonic()
    seq = Request(
        request_id=rid,
        prompt_ids=list(record.prompt_ids),
        params=record.params,
        max_tokens=record.max_tokens,
        seed=record.seed,
        eos_ids=engine.eos_ids,
        prompt=record.prompt,
        arrival_time=now - record.age_seconds,
        priority=record.priority,
        tenant=record.tenant,
        detokenizer=_detokenizer(engine, record),
        output_kind=OutputKind(record.output_kind),
        matcher=_matcher(engine, record),
    )
    seq.output_ids, seq.logprobs = list(record.output_ids), list(record.logprobs)
    seq.cumulative_logprob, seq.top_logprobs = record.cumulative_logprob, list(record.top_logprobs)
    if record.prompt_logprobs is not None:
        seq.prompt_logprobs = list(record.prompt_logprobs)
    seq.prompt_logprobs_sent = record.prompt_logprobs_sent
    seq.pending_text, seq.text_chunks = record.pending_text, list(record.text_chunks)
    seq.first_token_time = now - record.first_token_age
    seq.num_preemptions = record.num_preemptions
    # The device mirror: the prompt's K/V is in the pages, one sample drawn per output token.
    seq.prefill_ids = list(record.prompt_ids)
    seq.num_computed, seq.num_sampled = len(record.prompt_ids), len(record.output_ids)
    seq.swapped, seq.swapped_pages = engine.core.to_device(saved), record.num_pages
    engine.requests[rid] = seq
    engine.scheduler.add(seq)
    return seq


def free_pages(scheduler) -> int:
    """Pages a decode engine's ``scheduler`` can still give a handover: free (or only cached)
    ones, minus those the swap-ins it queues will take (how a decode engine is picked)."""
    return scheduler.allocator.num_free - sum(s.swapped_pages for s in scheduler.waiting)


def _detokenizer(engine, record: HandoverRecord) -> IncrementalDetokenizer | None:
    if record.detokenizer is None or engine.tokenizer is None:
        return None
    return IncrementalDetokenizer.from_state(engine.tokenizer, record.detokenizer)


def _matcher(engine, record: HandoverRecord):
    """A structured request's grammar matcher, advanced over the tokens sampled so far."""
    if record.params.structured is None:
        return None
    matcher = engine.intake.matcher(record.params)
    for token in record.output_ids:
        grammar.advance(matcher, token)
    return matcher
