"""Scheduler: decides each step's work on the host (plain Python, no JAX).

Per step, in this order:
1. **Decodes** — every running sequence past its prompt decodes one token. A sequence whose next
   token starts a new page gets one from the allocator; when none is free, the most recently
   admitted running sequence is preempted (recompute: its pages and slot are freed and it goes
   back to the front of the queue; on re-admission it re-prefills prompt + outputs so far).
2. **Prompt chunks** of running sequences still prefilling, under the token budget
   (``max_num_batched_tokens`` minus the decodes) and the largest row bucket.
3. **Admission** — waiting sequences (FCFS) take free slots while budget and pages remain; each
   starts with its first chunk (chunked prefill), so a long prompt never blocks decodes.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from jbatch.engine import buckets
from jbatch.engine.config import EngineConfig
from jbatch.engine.page_allocator import PageAllocator
from jbatch.engine.request import SeqStatus, Sequence


@dataclasses.dataclass
class Chunk:
    seq: Sequence
    start: int  # first position of the chunk
    token_ids: list[int]

    @property
    def completes_prompt(self) -> bool:
        return self.start + len(self.token_ids) == len(self.seq.prefill_ids)


@dataclasses.dataclass
class SchedulerOutput:
    releases: list[int] = dataclasses.field(default_factory=list)  # slots to retire first
    inserts: list[Sequence] = dataclasses.field(default_factory=list)
    decodes: list[Sequence] = dataclasses.field(default_factory=list)
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    page_writes: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    prompt_rows: int = 0  # chunk rows used, before rounding up to a bucket
    # (sequence, slot) of every sequence that receives a token from this step; the slot is kept
    # because a preemption may take it from the sequence before the token is read.
    samplers: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.decodes or self.chunks)


class Scheduler:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.allocator = PageAllocator(cfg.num_pages)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.free_slots: list[int] = list(range(cfg.max_slots))
        self.pending_releases: list[int] = []  # slots of finished sequences, to retire on device
        self.num_preemptions = 0
        self._admissions = 0

    # ---- bookkeeping ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Retire ``seq``: its slot and pages return at once (the device retires the slot before
        the next step)."""
        if seq.status is SeqStatus.RUNNING:
            self._free_slot(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _free_slot(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
        del self.running[seq.slot]
        self.free_slots.append(seq.slot)
        self.pending_releases.append(seq.slot)
        seq.slot = None

    def _preempt(self, seq: Sequence) -> None:
        self._free_slot(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- pages ---------------------------------------------------------------------------------
    def _grow(self, seq: Sequence, upto: int, out: SchedulerOutput) -> bool:
        """Give ``seq`` pages covering positions < ``upto``; all or nothing."""
        need = -(-upto // self.cfg.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        for page in self.allocator.allocate(need):
            out.page_writes.append((seq.slot, len(seq.pages), page))
            seq.pages.append(page)
        return True

    def _victim(self) -> Sequence:
        return max(self.running.values(), key=lambda s: s.admitted_at)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_decodes(out)
        budget = self.cfg.max_num_batched_tokens - len(out.decodes)
        rows = buckets.prefill_buckets(self.cfg)[-1]
        for seq in sorted(self.running.values(), key=lambda s: s.admitted_at):
            if seq.prefilling and budget > 0 and rows >= self.cfg.block_q:
                budget, rows = self._schedule_chunk(seq, budget, rows, out)
        self._admit(out, budget, rows)
        out.releases, self.pending_releases = self.pending_releases, []
        return out

    def break_deadlock(self) -> None:
        """Called when a step schedules nothing and nothing is in flight: running prompts are
        stuck without pages. Preempting the most recent one lets the older ones finish."""
        self._preempt(self._victim())

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        for seq in sorted(self.running.values(), key=lambda s: s.admitted_at):
            if seq.status is not SeqStatus.RUNNING or not seq.can_decode:
                continue
            while not self._grow(seq, seq.num_computed + 1, out):
                victim = self._victim()
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                out.decodes.append(seq)
                out.samplers.append((seq, seq.slot))
                seq.num_computed += 1
                seq.num_sampled += 1
                seq.inflight += 1

    def _schedule_chunk(self, seq: Sequence, budget: int, rows: int, out: SchedulerOutput):
        bq, page = self.cfg.block_q, self.cfg.page_size
        start = seq.num_computed
        n = min(len(seq.prefill_ids) - start, budget, rows)
        # Shrink to the pages that are free (whole pages beyond those already owned).
        room = (len(seq.pages) + self.allocator.num_free) * page - start
        n = min(n, room)
        if n <= 0 or not self._grow(seq, start + n, out):
            return budget, rows
        chunk = Chunk(seq, start, seq.prefill_ids[start : start + n])
        out.chunks.append(chunk)
        seq.num_computed += n
        if chunk.completes_prompt:
            out.samplers.append((seq, seq.slot))
            seq.num_sampled += 1
            seq.inflight += 1
        used = -(-n // bq) * bq
        out.prompt_rows += used
        return budget - n, rows - used

    def _admit(self, out: SchedulerOutput, budget: int, rows: int) -> None:
        skipped = []
        while self.waiting and self.free_slots and budget > 0 and rows >= self.cfg.block_q:
            seq = self.waiting.popleft()
            if seq.inflight:  # preempted with outputs still in flight: admit it next time
                skipped.append(seq)
                continue
            if self.allocator.num_free == 0:
                self.waiting.appendleft(seq)
                break
            slot = self.free_slots.pop(0)
            seq.start(slot, self._admissions)
            self._admissions += 1
            self.running[slot] = seq
            out.inserts.append(seq)
            budget, rows = self._schedule_chunk(seq, budget, rows, out)
        self.waiting.extendleft(reversed(skipped))

    def check_invariants(self) -> None:
        """Pages and slots are each in exactly one place (debug aid, used by tests)."""
        self.allocator.check()
        owned = [p for s in self.running.values() for p in s.pages]
        assert len(owned) == len(set(owned)), "a page is owned by two sequences"
        assert set(owned) == self.allocator._owned, "owned pages disagree with the allocator"
        assert sorted(self.free_slots + list(self.running)) == list(range(self.cfg.max_slots))
