"""Host side of speculative decoding: when an engine step speculates, what it proposes, and
how a speculative step's results become each request's tokens.

1. ``wanted``: a step speculates when it can be decode-only — no running prompt is still
   prefilling, no waiting request could take a free slot — and at most
   ``speculative_max_batch`` requests decode (above that, verifying K + 1 rows per request
   costs more than it saves), and some running request speculates (``Request.speculates``).
2. Such a step is **synchronous**: the engine first processes every step in flight, so each
   request's stream is known up to its last token (the proposer needs it, and the scheduler
   must know how far each request really got before giving it pages). Then
   ``Scheduler.schedule(propose)`` plans it, and its result is processed at once — the cost
   is the host/device overlap of one step (measured in ``docs/benchmarks.md``).
3. ``emitted``: per request, the tokens a step gave it — one for ordinary steps, the accepted
   proposals plus one for speculative steps, after which ``Scheduler.accept`` advances the
   request's counters and returns its pages past the new length.
"""

from __future__ import annotations

from jbatch.engine import ngram_proposer
from jbatch.engine.config import EngineConfig
from jbatch.engine.request import Request
from jbatch.engine.scheduler import Scheduler, SchedulerOutput


class Speculator:
    """The speculative-decoding policy and proposer of one engine (``cfg.speculative``)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg

    def wanted(self, scheduler: Scheduler) -> bool:
        """Whether the next step should speculate (module doc, 1)."""
        running = scheduler.running.values()
        if scheduler.waiting and scheduler.free_slots:
            return False
        decoding = 0
        speculating = False
        for seq in running:
            if seq.prefilling:
                return False
            decoding += 1
            speculating = speculating or seq.speculates
        return speculating and 0 < decoding <= self.cfg.speculative_max_batch

    def propose(self, seq: Request, k: int) -> list[int]:
        """Up to ``k`` proposals for ``seq`` (none for a request that does not speculate)."""
        if not seq.speculates:
            return []
        if seq.token_stream is None:
            seq.token_stream = ngram_proposer.TokenStream(seq.prompt_ids)
        stream = seq.token_stream.sync(seq.output_ids, len(seq.prompt_ids))
        return ngram_proposer.propose(stream, k, self.cfg.ngram_min, self.cfg.ngram_max)


def emitted(
    sched: SchedulerOutput, result, scheduler: Scheduler, counters
) -> list[tuple[Request, list[tuple[int, float]]]]:
    """Each sampling request of ``sched`` with its (token, logprob) pairs from ``result``."""
    tokens, logprobs = result.tokens.tolist(), result.logprobs.tolist()
    if sched.drafts is None:
        return [(seq, [(tokens[slot], logprobs[slot])]) for seq, slot in sched.samplers]
    spec_tokens, spec_logprobs, counts = result.spec
    out = []
    counters["spec_steps"] += 1
    for g, (seq, drafts) in enumerate(zip(sched.decodes, sched.drafts)):
        n = int(counts[g])
        if drafts:
            counters["spec_proposed_tokens"] += len(drafts)
            counters["spec_accepted_tokens"] += n - 1
            counters["spec_groups"] += 1
        if not seq.finished:
            scheduler.accept(seq, n - 1)
        pairs = zip(spec_tokens[g, :n].tolist(), spec_logprobs[g, :n].tolist())
        out.append((seq, list(pairs)))
    return out
