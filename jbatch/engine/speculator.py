"""Host side of speculative decoding: when an engine step speculates, what it proposes, and
how a speculative step's results become each request's tokens.

1. ``wanted``: a step speculates when it can be decode-only — no running prompt is still
   prefilling, no waiting request could take a slot free now or at the step's retirement
   (``Scheduler.slot_for_waiting``, as for blocks) — and at most
   ``speculative_max_batch`` requests decode (above that, verifying K + 1 rows per request
   costs more than it saves), and some running request speculates (``Request.speculates``).
2. Speculative steps overlap like ordinary ones: step N + 1 is planned and dispatched while
   step N runs, before the host knows how many of step N's proposals were accepted. So
   - pages are granted for the worst case (``Request.spec_pending``: the proposals a step in
     flight may still accept; ``Scheduler._proposal``), and a step is planned this way only
     when pages for every request's worst case are free (``overlaps``) — otherwise, and before
     any step that is not speculative, the step in flight is processed first, so planning
     never preempts on a guess;
   - n-gram proposals are looked up on the device (``ngram_device``): the host sends the
     stream as far as it has read it, and the device completes it with what the dispatch in
     flight emitted and the slot's real last token — so even the step after a rejection
     proposes. A draft model proposes on the device from the real last token too;
   - the device clips every group to its request's token budget and the pool it knows (the
     host's counters are lower bounds while a step runs).
   With ``decode_steps`` N > 1 a speculative dispatch runs up to N speculative steps
   (``spec_block.py``): a request is planned with one token and up to ``N (K + 1) - 1``
   pending ones (``propose``'s cap; one a step if it does not speculate).
3. ``emitted``: per request, the tokens a step gave it — one for ordinary steps, one per step
   it decoded in a block of decode steps (``decode_block.py``), the accepted proposals plus
   one per step of a speculative dispatch, after which ``Scheduler.accept`` advances the
   request's counters and returns its pages past what the device may still write.
"""

from __future__ import annotations

import numpy as np

from jbatch.engine import ngram_proposer
from jbatch.engine.config import EngineConfig
from jbatch.engine.request import Request
from jbatch.engine.scheduler import Scheduler
from jbatch.engine.scheduler_output import Proposal, SchedulerOutput


class Speculator:
    """The speculative-decoding policy and proposer of one engine (``cfg.speculative``)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg

    def wanted(self, scheduler: Scheduler) -> bool:
        """Whether the next step should speculate (module doc, 1)."""
        running = scheduler.running.values()
        if scheduler.slot_for_waiting():
            return False
        decoding = 0
        speculating = False
        for seq in running:
            if seq.prefilling:
                return False
            decoding += 1
            speculating = speculating or seq.speculates
        return speculating and 0 < decoding <= self.cfg.speculative_max_batch

    @staticmethod
    def overlaps(scheduler: Scheduler) -> bool:
        """Whether the next speculative step may be planned while one runs (module doc, 2):
        pages are free for every request's worst case, so planning needs no preemption."""
        return scheduler.spec_pages_needed() <= scheduler.allocator.num_free

    def propose(self, seq: Request, cap: int) -> Proposal:
        """``seq``'s proposal of up to ``cap`` tokens past its first (for a request that does
        not speculate, in a block: one a step, no proposals). The tokens themselves are found
        on the device: the draft model's, or an n-gram lookup in the stream sent here."""
        if not seq.speculates:
            return Proposal(cap, speculates=False)
        if self.cfg.speculative == "draft":  # the draft model proposes on the device
            return Proposal(cap)
        if seq.token_stream is None:
            seq.token_stream = ngram_proposer.TokenStream(seq.prompt_ids)
        stream = seq.token_stream.sync(seq.output_ids, len(seq.prompt_ids))
        # The device looks the n-grams up in this stream, completed (engine/ngram_device.py).
        return Proposal(cap, len(stream) - 1, stream)


def _block_emitted(sched: SchedulerOutput, block, scheduler: Scheduler, counters) -> list:
    """:func:`emitted` for a block of decode steps. Only one with an idle budget can end
    before its planned count (on a stop token, ``decode_block.py``): then each request that
    got fewer tokens than planned gives the rest back (``Scheduler.block_cut``), and the step
    counters count the steps it ran."""
    tokens, logprobs = block[0].T.tolist(), block[2].T.tolist()
    per_slot = block[1].sum(axis=0).tolist()  # the steps each slot sampled in
    got = [per_slot[slot] for _, slot in sched.samplers]
    out = [
        (seq, tokens[slot][:n], logprobs[slot][:n]) for (seq, slot), n in zip(sched.samplers, got)
    ]
    if sched.idle_budget is not None:
        for (seq, _), n, planned in zip(sched.samplers, got, sched.block_tokens):
            if n < planned and not seq.finished:
                scheduler.block_cut(seq, planned - n)
        ran = int(block[1].any(axis=1).sum())
        counters["blocks_ended_early"] += int(ran < sched.steps)
        counters["steps"] -= sched.steps - ran
        counters["decode_rows"] -= len(sched.decodes) * (sched.steps - ran)
    return out


def emitted(
    sched: SchedulerOutput, result, scheduler: Scheduler, counters
) -> list[tuple[Request, list[int], list[float]]]:
    """Each sampling request of ``sched`` with its tokens and their logprobs from ``result``."""
    if result.block is not None:  # a block of decode steps: each slot's sampled steps
        return _block_emitted(sched, result.block, scheduler, counters)
    tokens, logprobs = result.tokens.tolist(), result.logprobs.tolist()
    if sched.drafts is None:
        return [(seq, [tokens[slot]], [logprobs[slot]]) for seq, slot in sched.samplers]
    spec_tokens, spec_logprobs, counts, verified = result.spec  # [T, G, ...]: step, group
    ran = counts.any(axis=1)  # steps the dispatch ran
    counters["spec_steps"] += int(ran.sum())
    counters["steps"] += int(ran.sum())
    out = []
    for g, (seq, proposal) in enumerate(zip(sched.decodes, sched.drafts)):
        c, v = counts[:, g], verified[:, g]
        n, proposing = int(c.sum()), v > 0
        counters["spec_proposed_tokens"] += int(v.sum())
        counters["spec_accepted_tokens"] += int((c - 1)[proposing].sum())
        counters["spec_groups"] += int(proposing.sum())
        if not seq.finished:
            scheduler.accept(seq, n - 1, 0 if proposal is None else proposal.cap)
        on = np.arange(spec_tokens.shape[2]) < c[:, None]  # [T, K1]: emitted, step by step
        out.append((seq, spec_tokens[:, g][on].tolist(), spec_logprobs[:, g][on].tolist()))
    return out
