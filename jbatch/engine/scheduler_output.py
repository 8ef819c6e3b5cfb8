"""What the scheduler plans for one step (``Scheduler.schedule``), read by the batch builder
(``batch_builder.py``), the engine's dispatch and result reading (``llm_engine.py``,
``step_results.py``) and the speculator: a prompt ``Chunk``, a speculative ``Proposal``, and
the ``SchedulerOutput`` holding a step's whole plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from jbatch.engine.request import Request


@dataclasses.dataclass
class Chunk:
    seq: Request
    start: int  # first position of the chunk
    token_ids: list[int]

    @property
    def completes_prompt(self) -> bool:
        return self.start + len(self.token_ids) == len(self.seq.prefill_ids)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What a speculative dispatch may emit for one request beyond its first token
    (``spec_step.SpecBatch``)."""

    cap: int  # tokens past the first it may emit: their pages are granted
    anchor: int = 0  # stream index of the last token of ``tokens``
    # n-gram lookup: the stream as far as the host has read it (the device completes it and
    # looks up the proposals); empty: the device's draft model proposes.
    tokens: Seq[int] = ()
    # False: no proposals — the request decodes one token a step of the dispatch.
    speculates: bool = True


@dataclasses.dataclass
class SchedulerOutput:
    releases: list[int] = dataclasses.field(default_factory=list)  # slots to retire first
    inserts: list[Request] = dataclasses.field(default_factory=list)
    decodes: list[Request] = dataclasses.field(default_factory=list)
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    page_writes: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    # Swap preemption: (sequence, slot, pages) copied out before the step / written back after it
    # (a swapped-in sequence runs from the next step on).
    swap_outs: list[tuple[Request, int, list[int]]] = dataclasses.field(default_factory=list)
    swap_ins: list[tuple[Request, int, list[int]]] = dataclasses.field(default_factory=list)
    # Prefill role: (sequence, slot, pages) of prompts done, copied out before the step for a
    # decode engine (``handover.py``); their slots and pages are free for this step.
    handovers: list[tuple[Request, int, list[int]]] = dataclasses.field(default_factory=list)
    prompt_rows: int = 0  # chunk rows used (whole blocks), before rounding up to a bucket
    prompt_tokens: int = 0  # the chunks' tokens: what a packed region's dense rows hold
    paced_pairs: int = 0  # query-key pairs of paced chunks (``prefill_pacer.py``)
    dispatched_at: float = 0.0  # when the engine dispatched the step (perf_counter)
    # (sequence, slot) of every sequence that receives a token from this step; the slot is kept
    # because a preemption may take it from the sequence before the token is read.
    samplers: list[tuple[Request, int]] = dataclasses.field(default_factory=list)
    # Prompt rows whose logprobs this step computes (seq, first row, first prompt index, rows),
    # listed by ``logprob_host.fill_step``.
    prompt_logprob_rows: list[tuple[Request, int, int, int]] = dataclasses.field(
        default_factory=list
    )
    # A speculative dispatch (``spec_block.py``; decode only): each decode's proposal (None: it
    # decodes one token), in the order of ``decodes``; None for an ordinary step.
    drafts: list[Proposal | None] | None = None
    # Steps the dispatch runs as one block (``Scheduler.block_steps``, or an admission block:
    # the first step with the prompt chunks; each request that samples gets up to this many
    # tokens, its token budget permitting) or speculative steps a speculative dispatch runs at
    # most; 1 for ordinary steps.
    steps: int = 1
    # A block: the tokens each request that samples was planned, in the order of
    # ``samplers``; and, when it may end early on stop tokens (``decode_block.py``), the
    # slot-steps it may leave idle behind them (None: it runs its whole count).
    block_tokens: list[int] = dataclasses.field(default_factory=list)
    idle_budget: int | None = None

    @property
    def empty(self) -> bool:
        return not (self.decodes or self.chunks)

    @property
    def admission_block(self) -> bool:
        """A step with prompt chunks that runs on as a block (``Scheduler.admission_block``)."""
        return self.steps > 1 and bool(self.chunks)
