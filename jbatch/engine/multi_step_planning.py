"""The scheduler's planning of dispatches that run several steps: blocks of decode steps
(``decode_block.py``) and speculative dispatches (``spec_step.py``, ``spec_block.py``).

:class:`MultiStepPlanning` is a part of :class:`scheduler.Scheduler` (its base class), kept
apart because these rules read and grant more than one step ahead:

1. ``block_steps`` decides how many decode steps the next dispatch may run (1: an ordinary
   step); ``Scheduler.schedule(steps=N)`` then gives each decode up to N tokens and grows its
   pages for all of them. An ordinary step that prefilled prompts may itself run on as a block
   (``admission_block``), under the same rules, saving the block's own dispatch.
2. A block planned while requests queue and a request may stop on a token carries an idle
   budget (``_block_idle_budget``) within which the device may run on past a stop; a block
   the device ended early gives back the tokens planned past its end (``block_cut``).
3. A speculative dispatch grants each request its proposal's pages for the worst case
   (``_proposal``; ``spec_pages_needed`` tells the engine whether it can plan one while
   another runs) and ``accept`` settles them once the device has verified.
"""

from __future__ import annotations

from jbatch.engine import buckets, stop_checker
from jbatch.engine.request import Request
from jbatch.engine.scheduler_output import Proposal, SchedulerOutput

# While requests queue, a block of decode steps may leave at most this many steps' worth of
# slot rows idle (``block_steps``). Demo model, 32 slots, 256 queued requests, blocks of 16:
# 0 (end at the first request's end) gave 0.41 dispatches per step and a host share of
# 17-22%; 2 gave 0.12 and 8-10%, throughput +3.5% (median of 6 interleaved runs;
# docs/benchmarks.md).
BLOCK_IDLE_STEPS = 2


class MultiStepPlanning:
    """Methods of :class:`scheduler.Scheduler` (they use its pool, queues and page growth)."""

    def block_steps(self) -> int:
        """Decode steps the next step may run as one block (``EngineConfig.decode_steps``;
        1: an ordinary step): every running request is past its prompt and needs nothing from
        the host between its tokens (a grammar's mask, top logprobs), no waiting request could
        take a slot free now or at this step's retirement, and the pool has the pages every
        request's whole block needs (planning a block never preempts). Never more steps than
        the request with the most tokens left can use, and while requests queue, no more than
        leave ``BLOCK_IDLE_STEPS`` steps' worth of slot rows idle (the slots of requests that
        end inside the block wait for its end; the queue then gets them in one admission
        step): a dispatch saved is worth more than a few idle rows of one. Without a queue, no
        longer than the requests still decoding need the block's decode bucket
        (:meth:`_until_smaller_bucket`)."""
        steps = self.cfg.decode_steps
        if steps == 1 or not self.running or self.slot_for_waiting():
            return 1
        need, ns = 0, []
        for seq in self.running.values():
            if seq.prefilling or seq.host_per_token:
                return 1
            if seq.can_decode:
                n = min(steps, seq.max_tokens - seq.num_sampled)
                need += max(0, self._pages_short(seq, self._reach(seq, n - 1)))
                ns.append(n)
        if need > self.allocator.num_free:
            return 1
        if not self.waiting:
            return self._until_smaller_bucket(ns, max(ns, default=1))
        return self._within_idle_budget(ns)

    def _within_idle_budget(self, ns: list[int]) -> int:
        """A block's length while requests queue (``ns``: the steps each request can use): past
        the first request's end its slot idles until the block ends, so it runs on while the
        idle slot-steps stay within ``BLOCK_IDLE_STEPS`` steps' worth of slots."""
        budget = BLOCK_IDLE_STEPS * self.cfg.max_slots
        b, most = min(ns, default=self.cfg.decode_steps), max(ns, default=1)
        while b < most and sum(max(0, b + 1 - n) for n in ns) <= budget:
            b += 1
        return b

    def admission_block(self, out: SchedulerOutput) -> None:
        """Run the ordinary step ``out``, which prefills prompts, on as a block of decode steps
        (an *admission block*, ``decode_block.admission_block``) where a block could follow it
        anyway: after it every running request decodes (no prompt still prefilling, nothing
        needs the host between tokens), no slot is left free while requests wait (the token
        budget ran out: the next step admits into it; a request at its last token idles its
        slot within the idle budget instead), nothing swaps, the step's decodes fill the
        bucket of every slot's row anyway (its program lists every slot:
        ``buckets.runs_blocks``), and the pool has every request's pages for the whole block
        (planning it never preempts). Its length follows :meth:`block_steps`' rules; every
        request sampling in the step gets the later steps' tokens its budget allows, with
        their pages. Saves the dispatch (and the host's round) of the block that would
        follow."""
        ns = self._admission_tokens(out)
        if ns is None:
            return
        reach = [self._reach(seq, n - 2) for (seq, _), n in zip(out.samplers, ns)]
        need = sum(max(0, self._pages_short(s, r)) for (s, _), r in zip(out.samplers, reach))
        if need > self.allocator.num_free:
            return
        out.steps, tenants = max(ns), {}
        for (seq, _), n, upto in zip(out.samplers, ns, reach):
            self._grow(seq, upto, out)
            extra = n - 1
            seq.num_computed += extra
            seq.num_sampled += extra
            if extra and seq.num_sampled >= seq.max_tokens and seq not in self._last_samples:
                self._last_samples.append(seq)
            tenants[seq.tenant] = tenants.get(seq.tenant, 0) + extra
            out.block_tokens.append(n)
        for tenant, n in tenants.items():
            self.ledger.charge(tenant, output=n)
        out.idle_budget = self._block_idle_budget(out)

    def _admission_tokens(self, out: SchedulerOutput) -> list[int] | None:
        """The tokens each request sampling in ``out`` would get in its admission block (the
        order of ``samplers``; the block's length is the largest), None: no block."""
        # A request at its last token (``slot_for_waiting``'s other case) is no reason not
        # to: its slot idles within the idle budget, like one that ends inside the block.
        # Requests ending one a step had made every admission an ordinary step (demo model,
        # 32 slots, 256 long-tail requests: 69 of 120 dispatches; 39 of 91 after).
        if not (out.chunks and buckets.admission_blocks(self.cfg)) or self.free_slot_waited_for():
            return None
        if out.swap_ins or out.swap_outs or out.paced_pairs:  # (the pacer times single steps)
            return None
        # Its steps list every slot: only where the step's decodes need that bucket anyway.
        pair = buckets.pick_pair(self.cfg, out.prompt_rows, len(out.decodes), out.prompt_tokens)
        if pair[1] != self.cfg.max_slots:
            return None
        if any(s.prefilling or s.host_per_token for s in self.running.values()):
            return None
        steps = self.cfg.decode_steps
        ns = [min(steps, 1 + seq.max_tokens - seq.num_sampled) for seq, _ in out.samplers]
        if not ns or max(ns) < 2:
            return None
        if self.waiting:
            b = self._within_idle_budget(ns)
        else:  # its later steps decode every slot's row: only while most slots decode
            smaller = [b for b in buckets.decode_buckets(self.cfg, 0) if b < self.cfg.max_slots]
            if smaller and len(ns) <= smaller[-1]:
                return None
            b = self._until_smaller_bucket(ns, max(ns))
        return [min(b, n) for n in ns] if b > 1 else None

    def _until_smaller_bucket(self, ns: list[int], most: int) -> int:
        """A block without a queue: it pays its decode bucket's rows every step, so it runs
        only until the requests still decoding (``ns``: the steps each can use) would fit the
        next smaller decode bucket, else to ``most``."""
        smaller = [b for b in buckets.decode_buckets(self.cfg, 0) if b < len(ns)]
        if not smaller:  # already the smallest bucket
            return most
        # After k steps, n > k requests still decode; they fit ``smaller[-1]`` rows once k
        # reaches the (smaller[-1] + 1)-th largest n.
        return max(1, min(most, sorted(ns, reverse=True)[smaller[-1]]))

    def slot_for_waiting(self) -> bool:
        """Whether a waiting request could take a slot free now or at the next step's
        retirement: that step should admit it (an ordinary step), not run a block of decode
        steps or a speculative step, which admit nobody."""
        return self.free_slot_waited_for() or (bool(self.waiting) and bool(self._last_samples))

    def free_slot_waited_for(self) -> bool:
        """Whether a slot is free while requests wait: the next step admits into it."""
        return bool(self.waiting) and bool(self.free_slots)

    def may_stop_early(self) -> bool:
        """Whether a running request could end before its token budget (EOS, a stop token or
        string: ``stop_checker.may_stop_early``)."""
        return any(stop_checker.may_stop_early(seq) for seq in self.running.values())

    def block_cut(self, seq: Request, missing: int) -> None:
        """A block of decode steps ended early on the device (a stop token): ``seq`` got
        ``missing`` fewer tokens than planned. Its counters go back, and it no longer has its
        last token in flight; its pages for them stay (the next steps fill them). Its tenant
        stays charged for them: the fair queue's counters only grow (``fair_queue.py``)."""
        seq.num_computed -= missing
        seq.num_sampled -= missing
        if seq in self._last_samples and seq.num_sampled < seq.max_tokens:
            self._last_samples.remove(seq)

    def _proposal(self, seq: Request, propose, out: SchedulerOutput) -> Proposal | None:
        """``seq``'s proposal for a speculative dispatch of ``out.steps`` steps, with pages for
        all of it (no pages free: none; speculation never preempts anyone). At most K tokens a
        step plus the token each further step emits (one a step for a request that does not
        speculate), and never past the request's token budget or ``max_seq_len`` as far as
        the host knows (the device clips to what it knows: a step in flight may have emitted
        more)."""
        per_step = self.cfg.num_speculative_tokens + 1 if seq.speculates else 1
        cap = min(
            out.steps * per_step - 1,
            seq.max_tokens - seq.num_sampled - 1,
            self.cfg.max_seq_len - seq.num_computed - 1,
        )
        proposal = propose(seq, cap) if cap > 0 else None
        if proposal is None:
            return None
        upto = self._reach(seq, cap)
        # Keep a page in reserve per running request, so the others' next tokens still fit.
        if self._pages_short(seq, upto) > self.allocator.num_free - len(self.running):
            return None
        self._grow(seq, upto, out)
        seq.spec_pending += cap
        return proposal

    def spec_pages_needed(self) -> int:
        """Pages a speculative dispatch would take at most if every request got all it may
        emit (``buckets.spec_extra``; the engine plans one while another runs only when they
        are free: no preemption)."""
        extra = buckets.spec_extra(self.cfg)
        reach = lambda s: self._reach(s, extra)
        need = sum(max(0, self._pages_short(s, reach(s))) for s in self.running.values())
        return need + len(self.running)  # the reserve of ``_proposal``

    def accept(self, seq: Request, extra: int, settled: int) -> None:
        """A speculative step emitted ``extra`` tokens for ``seq`` beyond the one it was planned
        with (-1: none, the device found the request done) and settles ``settled`` of its
        ``spec_pending``: advance its counters, and return the pages past what the device may
        still write (their K/V came from rejected proposals; the next step allocates afresh)."""
        seq.num_computed += extra
        seq.num_sampled += extra
        seq.spec_pending = max(0, seq.spec_pending - settled)
        if extra > 0:
            self.ledger.charge(seq.tenant, output=extra)
        keep = -(-(seq.num_computed + seq.spec_pending) // self.cfg.page_size)
        if len(seq.pages) > keep:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    def _block_idle_budget(self, out: SchedulerOutput) -> int | None:
        """For a block planned while requests queue and a request may stop on a token: the
        slot-steps the device may still leave idle behind stop tokens (what the plan's own
        idle rows leave of the allowance; ``decode_block.py``). None: it runs its whole
        count."""
        if out.steps == 1 or not (self.waiting and self.may_stop_early()):
            return None
        planned_idle = sum(out.steps - n for n in out.block_tokens)
        return max(0, BLOCK_IDLE_STEPS * self.cfg.max_slots - planned_idle)
