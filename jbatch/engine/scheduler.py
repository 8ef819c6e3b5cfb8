"""Scheduler: decides each step's work on the host (plain Python, no JAX).

Per step, in this order:
1. **Decodes** — every running sequence past its prompt decodes one token. A sequence whose next
   token starts a new page gets one from the allocator; when none is free, a victim is
   preempted — the lowest priority, then the most recently admitted (recompute: its slot and
   pages are freed — its full pages stay in the prefix cache — and it is requeued; on
   re-admission it prefills prompt + outputs so far, mostly from the cache).
2. **Prompt chunks** of running sequences still prefilling, under the token budget
   (``max_num_batched_tokens`` minus the decodes) and a row cap: the prefill bucket nearest
   the rows that could go (``prompt_rows.py``), so a step's prompt region is mostly real rows.
3. **Admission** — waiting sequences take free slots while budget and pages remain, in order of
   effective priority (``priority`` minus one per ``aging_steps`` waited since arrival; lower
   first), FCFS within a priority; a preempted sequence keeps its place (a heap:
   ``waiting_queue.py``). Full prompt pages already in the prefix cache are reused, not
   recomputed, and so are the prompt pages a sibling sequence of the same request (n > 1)
   has computed (``parent_request.py``); the rest is prefilled in chunks, so a long prompt never
   blocks decodes.

**Retirement**: a sequence whose last token (``max_tokens``, which fits ``max_seq_len``) is in a
dispatched step can never be scheduled again, so the next ``schedule`` gives its slot to that
step's admissions (the step program retires the slot before it inserts: the new sequence starts
one step earlier than if the slot waited for the token to be read). Its pages stay until the token
is read — the last K/V is written by the step in flight, and only then can its pages be named in
the prefix cache — and ``finish`` frees them. A stop token read earlier just finishes it sooner.

The admission and eviction orders above are the ``priority`` policy; ``policies.py`` holds the
others (``fcfs``, ``fair``). Whatever the policy, each tenant's service is charged to a
``TenantLedger`` as it is scheduled (prompt tokens per chunk, one output token per sample).
"""

from __future__ import annotations

import contextlib

from jbatch.engine import buckets, prompt_rows
from jbatch.engine.config import EngineConfig
from jbatch.engine.multi_step_planning import MultiStepPlanning
from jbatch.engine.page_allocator import PageAllocator
from jbatch.engine.parent_request import sibling_prompt_pages
from jbatch.engine.policies import VictimOrder, waiting_queue
from jbatch.engine.prefill_pacer import PrefillPacer
from jbatch.engine.request import Request, RequestStatus
from jbatch.engine.scheduler_output import Chunk, SchedulerOutput
from jbatch.engine.tenants import TenantLedger


class Scheduler(MultiStepPlanning):
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.allocator = PageAllocator(cfg.num_pages, cfg.enable_prefix_caching)
        self.ledger = TenantLedger(cfg.tenant_weights)
        self.waiting = waiting_queue(cfg, self.ledger)
        self.victim_order = VictimOrder(cfg.scheduling_policy, self.ledger)
        self.pacer = PrefillPacer(cfg.prefill_pacing, cfg.block_q) if cfg.prefill_pacing else None
        self.running: dict[int, Request] = {}  # slot -> sequence
        self.free_slots: list[int] = list(range(cfg.max_slots))
        self.pending_releases: list[int] = []  # slots of finished sequences, to retire on device
        self._last_samples: list[Request] = []  # scheduled their last token this step
        self.retiring: dict[int, Request] = {}  # id -> sequence: last token in flight, no slot
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls: the clock for aging and waits
        self._admissions = 0
        self._arrivals = 0

    # ---- bookkeeping ---------------------------------------------------------------------------
    def add(self, seq: Request) -> None:
        seq.arrival_order, self._arrivals = self._arrivals, self._arrivals + 1
        seq.waiting_since = self.num_steps
        self.waiting.push(seq)

    def finish(self, seq: Request, reason: str, stop_reason=None) -> None:
        """Retire ``seq``: its slot and pages return at once (the device retires the slot before
        the next step)."""
        if seq.status is RequestStatus.RUNNING:
            self._free_slot(seq)
        elif seq.status is RequestStatus.RETIRING:
            del self.retiring[id(seq)]
            self._free_pages(seq)
        elif seq.status is RequestStatus.WAITING:
            self.waiting.remove(seq)
            seq.swapped = None
        seq.status = RequestStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _free_slot(self, seq: Request) -> None:
        self._free_pages(seq)
        self._release_slot(seq)

    def _free_pages(self, seq: Request) -> None:
        self._cache_generated_pages(seq)
        self.allocator.free(seq.pages)
        seq.pages, seq.spec_pending = [], 0

    def _release_slot(self, seq: Request) -> None:
        del self.running[seq.slot]
        self.free_slots.append(seq.slot)
        self.pending_releases.append(seq.slot)
        seq.slot = None

    def _sampled(self, seq: Request, n: int = 1) -> None:
        """Count ``n`` scheduled samples of ``seq`` (one step's); note it when it got its last."""
        seq.num_sampled += n
        seq.inflight += 1
        if seq.num_sampled >= seq.max_tokens and self.cfg.role != "prefill":
            self._last_samples.append(seq)

    def _retire(self) -> None:
        """Retirement (module doc): the slots of sequences whose last token was scheduled in
        the previous step (that step's batch is built, so their slot numbers are no longer
        read) go back to the free list."""
        for seq in self._last_samples:
            if seq.status is RequestStatus.RUNNING and seq.num_sampled >= seq.max_tokens:
                self._release_slot(seq)
                seq.status = RequestStatus.RETIRING
                self.retiring[id(seq)] = seq
        self._last_samples = []

    def _swap_instead(self, seq: Request) -> bool:
        mode = self.cfg.preemption_mode
        if self.cfg.role == "decode":
            return True  # a decode engine has no prefill programs to recompute with
        return mode == "swap" or (
            mode == "auto" and seq.num_computed > self.cfg.max_num_batched_tokens
        )

    def _preempt(self, seq: Request, out: SchedulerOutput | None = None) -> None:
        """Evict ``seq`` (swap needs ``out``, where the copy-out is scheduled)."""
        if out is not None and self._swap_instead(seq):
            out.swap_outs.append((seq, seq.slot, list(seq.pages)))
            seq.swapped_pages = len(seq.pages)
        else:  # recompute: forget the device state; re-prefill prompt + outputs later
            seq.swapped_pages = 0
        seq.preempted_at = self.num_steps
        self._free_slot(seq)
        seq.status = RequestStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)  # keeps its arrival step: back at the front of its priority

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.retiring)

    # ---- pages ---------------------------------------------------------------------------------
    def _grow(self, seq: Request, upto: int, out: SchedulerOutput) -> bool:
        """Give ``seq`` pages covering positions < ``upto``; all or nothing."""
        need = self._pages_short(seq, upto)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        for page in self.allocator.allocate(need):
            out.page_writes.append((seq.slot, len(seq.pages), page))
            seq.pages.append(page)
        return True

    def _pages_short(self, seq: Request, upto: int) -> int:
        """Pages ``seq`` lacks to cover positions < ``upto`` (<= 0: none)."""
        return -(-upto // self.cfg.page_size) - len(seq.pages)

    def _reach(self, seq: Request, extra: int) -> int:
        """Positions a decode of ``seq`` with ``extra`` proposals may write below, if a step
        in flight accepted all its ``spec_pending`` proposals (at most ``max_seq_len``)."""
        return min(seq.num_computed + seq.spec_pending + 1 + extra, self.cfg.max_seq_len)

    def _victim_key(self, seq: Request) -> tuple:
        return self.victim_order.key(seq)

    def _victim(self) -> Request:
        """The policy's first victim (``priority``: lowest priority, i.e. largest number, then
        the most recently admitted). Running sequences are scheduled in the opposite order, so a
        victim is never one this step has already scheduled."""
        return max(self.running.values(), key=self._victim_key)

    # ---- prefix cache --------------------------------------------------------------------------
    def _cacheable(self, seq: Request) -> bool:
        # Penalties need every prompt/output token to pass through the step (prompt mask and
        # output counts live on the device), prompt logprobs every prompt row's logits, so such
        # requests do not *reuse* cached pages.
        no_reuse = seq.uses_penalties or seq.params.prompt_logprobs is not None
        return self.cfg.enable_prefix_caching and not no_reuse

    def _register_full_pages(self, seq: Request, upto: int) -> None:
        """Name every full page of ``seq`` holding stream tokens < ``upto`` in the prefix cache
        (only pages not registered yet: O(new pages))."""
        if not self.cfg.enable_prefix_caching:
            return
        page = self.cfg.page_size
        n = seq.hash_pages(min(upto, len(seq.pages) * page), page)
        for i in range(seq.registered_pages, n):
            self.allocator.register(seq.pages[i], seq.page_hash_chain[i])
        seq.registered_pages = max(seq.registered_pages, n)

    def _cache_generated_pages(self, seq: Request) -> None:
        # Tokens whose K/V are surely written: all but the last output (it was never fed back).
        self._register_full_pages(seq, min(seq.num_tokens - 1, seq.num_computed))

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self, propose=None, steps: int = 1) -> SchedulerOutput:
        """Plan one step. ``propose(seq, cap) -> Proposal | None``: plan a speculative dispatch
        of ``steps`` steps instead — decodes only, each with its proposal (pages for all of it,
        or none). ``steps`` > 1 (from :meth:`block_steps`): plan a block of that many decode
        steps — decodes only, each request up to its token budget, with pages for all of
        them. An ordinary step may still come out as a block (:meth:`admission_block`)."""
        self.num_steps += 1
        self._retire()
        out = SchedulerOutput(steps=steps)
        running = list(self.running.values())
        self.victim_order.begin_step(running)
        # Scheduling order: the reverse of eviction. The keys are fixed for the step, so one
        # sort serves decodes and prompt chunks (the preempted are skipped by status).
        order = sorted(running, key=self._victim_key)
        if propose is not None or steps > 1:
            out.drafts = [] if propose is not None else None
            self._schedule_decodes(out, order, propose)
            if out.drafts is not None and all(p is None for p in out.drafts):
                out.drafts, out.steps = None, 1  # nothing to verify: an ordinary decode step
            if out.drafts is None:
                out.idle_budget = self._block_idle_budget(out)
            out.releases, self.pending_releases = self.pending_releases, []
            return out
        if self.cfg.role == "prefill":
            self._schedule_handovers(out)
        else:
            self._schedule_decodes(out, order)
        budget = self.cfg.max_num_batched_tokens - len(out.decodes)
        free = len(self.free_slots)
        rows = prompt_rows.row_cap(
            self.cfg, order, self.waiting, free, self.num_steps, budget, len(out.decodes)
        )
        budget = min(budget, buckets.dense_rows(self.cfg, rows))  # a packed region's tokens
        for seq in order:
            running_prompt = seq.status is RequestStatus.RUNNING and seq.prefilling
            if running_prompt and budget > 0 and rows >= self.cfg.block_q:
                paced, cap = self._pacing(seq, out)
                if cap != 0:
                    budget, rows = self._schedule_chunk(seq, budget, rows, out, cap, paced)
        self._admit(out, budget, rows)
        self.admission_block(out)  # run on as a block of decode steps, where one could follow
        if out.paced_pairs:  # paced chunks, an admitted long prompt's first one included
            self.pacer.scheduled()
        out.releases, self.pending_releases = self.pending_releases, []
        return out

    def break_deadlock(self) -> None:
        """Called when a step schedules nothing and nothing is in flight: running prompts are
        stuck without pages. Preempting the most recent one lets the older ones finish."""
        self.victim_order.begin_step(list(self.running.values()))
        self._preempt(self._victim())

    def _schedule_decodes(self, out: SchedulerOutput, order: list[Request], propose=None) -> None:
        tenants: dict[str, int] = {}  # output tokens per tenant, charged once per tenant
        for seq in order:
            if seq.status is not RequestStatus.RUNNING or not seq.can_decode:
                continue
            drafts = self._proposal(seq, propose, out) if propose is not None else None
            # Tokens it surely decodes (a speculative dispatch: one, the rest are pending).
            n = 1 if propose is not None else min(out.steps, seq.max_tokens - seq.num_sampled)
            while not self._grow(seq, self._reach(seq, n - 1), out):
                victim = self._victim()
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is RequestStatus.RUNNING:
                out.decodes.append(seq)
                if out.drafts is not None:
                    out.drafts.append(drafts)
                out.samplers.append((seq, seq.slot))
                if out.steps > 1 and propose is None:
                    out.block_tokens.append(n)
                seq.num_computed += n
                self._sampled(seq, n)
                tenants[seq.tenant] = tenants.get(seq.tenant, 0) + n
        for tenant, n in tenants.items():
            self.ledger.charge(tenant, output=n)

    def _schedule_handovers(self, out: SchedulerOutput) -> None:
        """Prefill role: a request whose last prompt chunk went out in an earlier step (its
        first token is in the device state, or on its way) is copied out for a decode engine;
        its slot and pages are free for this step, as after a swap-out."""
        for seq in [s for s in self.running.values() if not s.prefilling]:
            out.handovers.append((seq, seq.slot, list(seq.pages)))
            seq.swapped_pages = len(seq.pages)
            self._free_slot(seq)
            seq.status = RequestStatus.HANDED_OVER

    def _pacing(self, seq: Request, out: SchedulerOutput) -> tuple[bool, int | None]:
        """Whether ``seq``'s next chunk is paced (``prefill_pacer.py``: a chunk of a prompt
        longer than the step budget, while others decode: its cost is measured and owed), and
        the most tokens it may take (None: no limit, 0: it waits this step). The prompt's first
        budget's worth goes at once, and only that: a first chunk shortened by the decodes
        leaves just the rest of it, not a second whole chunk."""
        pacer, budget = self.pacer, self.cfg.max_num_batched_tokens
        if pacer is None or not out.decodes or len(seq.prefill_ids) <= budget:
            return False, None
        if seq.num_computed < budget:
            return True, budget - seq.num_computed
        return True, 0 if pacer.blocked else pacer.chunk_tokens(seq.num_computed)

    def _schedule_chunk(
        self,
        seq: Request,
        budget: int,
        rows: int,
        out: SchedulerOutput,
        cap: int | None = None,
        paced: bool = False,
    ):
        bq, page = self.cfg.block_q, self.cfg.page_size
        start = seq.num_computed
        n = min(len(seq.prefill_ids) - start, budget, rows, cap or budget)
        # Shrink to the pages that are free (whole pages beyond those already owned).
        room = (len(seq.pages) + self.allocator.num_free) * page - start
        n = min(n, room)
        if n <= 0 or not self._grow(seq, start + n, out):
            return budget, rows
        chunk = Chunk(seq, start, seq.prefill_ids[start : start + n])
        out.chunks.append(chunk)
        if paced:
            out.paced_pairs += PrefillPacer.pairs(start, n)
        seq.num_computed += n
        self.ledger.charge(seq.tenant, prompt=n, output=int(chunk.completes_prompt))
        if seq.first_scheduled_step is None:
            seq.first_scheduled_step = self.num_steps
        self._register_full_pages(seq, seq.num_computed)
        if chunk.completes_prompt:
            out.samplers.append((seq, seq.slot))
            self._sampled(seq)
        used = -(-n // bq) * bq
        out.prompt_rows += used
        out.prompt_tokens += n
        return budget - n, rows - used

    def _admit(self, out: SchedulerOutput, budget: int, rows: int) -> None:
        if not self.free_slots:
            return
        with contextlib.closing(self.waiting.in_order()) as queue:
            self._admit_from(queue, out, budget, rows)

    def _admit_from(self, queue, out: SchedulerOutput, budget: int, rows: int) -> None:
        for seq in queue:
            if not (self.free_slots and budget > 0 and rows >= self.cfg.block_q):
                break
            if seq.held_back(self.num_steps):
                continue
            if seq.swapped_pages:
                pages = self._swap_in_pages(seq)
                if pages is None:
                    break  # the head of the queue waits for pages; nobody overtakes it
                self.waiting.remove(seq)
                slot = self.free_slots.pop(0)
                seq.resume(slot, self._admissions, pages)
                seq.registered_pages = seq.swap_shared_pages  # the hits are registered already
                self._admissions += 1
                self.running[slot] = seq
                out.swap_ins.append((seq, slot, pages))  # written back after this step
                continue
            cached = self._start_pages(seq, out)
            if cached is None:
                continue  # a sibling computes the prompt pages it will share (n > 1)
            if self.allocator.num_free == 0 and not cached:
                break  # the head of the queue waits for pages; nobody overtakes it
            self.waiting.remove(seq)
            slot = self.free_slots.pop(0)
            seq.start(slot, self._admissions, cached, self.cfg.page_size)
            self._admissions += 1
            self.running[slot] = seq
            out.inserts.append(seq)
            paced, cap = self._pacing(seq, out)  # a blocked pacer: one block to start with
            cap = self.cfg.block_q if cap == 0 else cap
            budget, rows = self._schedule_chunk(seq, budget, rows, out, cap, paced)

    def _swap_in_pages(self, seq: Request) -> list[int] | None:
        """Pages for a swapped-out (or handed-over) sequence: its full pages the prefix cache
        holds — the same tokens' K/V, shared — then fresh ones; None if too few are free."""
        hits = []
        if self._cacheable(seq):
            n = seq.hash_pages(min(seq.num_computed, seq.num_tokens - 1), self.cfg.page_size)
            hits = self.allocator.lookup(seq.page_hash_chain[: min(n, seq.swapped_pages)])
        need = seq.swapped_pages - len(hits)
        if need > self.allocator.num_free:
            self.allocator.free(hits)
            return None
        seq.swap_shared_pages = len(hits)
        return hits + self.allocator.allocate(need)

    def _start_pages(self, seq: Request, out: SchedulerOutput) -> list[int] | None:
        """Pages ``seq`` starts with, referenced, not computed: its siblings' prompt pages
        (n > 1), then prefix-cache hits. None: wait for a sibling computing them now."""
        fresh = {id(s) for s, _, _ in out.swap_ins}
        shared = sibling_prompt_pages(seq, self.cfg.page_size, fresh)
        if shared is None:
            return None
        pages = self.allocator.share(shared)
        if self._cacheable(seq):
            n = seq.hash_pages(seq.num_tokens - 1, self.cfg.page_size)
            if n > len(pages):
                pages += self.allocator.lookup(seq.page_hash_chain[len(pages) : n])
        return pages

    def check_invariants(self) -> None:
        """Pages and slots are each in exactly one place; refcounts match the page tables;
        a page shared by two sequences is a full cached prefix page (debug aid, used by tests)."""
        holders = [*self.running.values(), *self.retiring.values()]
        self.allocator.check([s.pages for s in holders])
        assert all(s.status is RequestStatus.RETIRING for s in self.retiring.values())
        for seq in self.running.values():
            assert len(set(seq.pages)) == len(seq.pages), "a page twice in one page table"
            assert len(seq.pages) <= self.cfg.max_pages_per_seq, "pages past the page table"
            for i, page in enumerate(seq.pages):
                if self.allocator.refcount(page) > 1:
                    assert (i + 1) * self.cfg.page_size <= seq.num_computed, "shared partial page"
        assert sorted(self.free_slots + list(self.running)) == list(range(self.cfg.max_slots))
        waiting = {id(s) for s in self.waiting}
        assert not waiting & {id(s) for s in self.running.values()}, "sequence waiting and running"
