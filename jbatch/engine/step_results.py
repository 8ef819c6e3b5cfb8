"""One step's device result, read on the host: sampled tokens into requests, outputs out.

For each request that sampled in the step (``SchedulerOutput.samplers``), in slot order:

1. a structured request's grammar takes its token first (:func:`advance_grammars`, which the
   engine may run early, before the next step's bitmask is filled);
2. the tokens it emitted — one, or several after a speculative step
   (``speculator.emitted``) — are appended with their logprobs, the stop checks cutting the run
   at the first stop;
3. a finished request hands its slot and pages back to the scheduler at once;
4. a ``RequestOutput`` delta is built (``request_output.step_output``), and the children of an
   ``n > 1`` request are merged into one output per request.

Host work is O(1) per token: nothing here re-reads a request's whole output.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from jbatch.engine import grammar, logprob_host, request_output, speculator, stop_checker
from jbatch.engine.parent_request import merge_outputs
from jbatch.engine.request import Request
from jbatch.engine.scheduler import Scheduler
from jbatch.engine.scheduler_output import SchedulerOutput
from jbatch.outputs import RequestOutput


def advance_grammars(sched: SchedulerOutput, tokens: np.ndarray) -> dict[int, tuple]:
    """Feed each running structured request its sampled token; the ones that must end
    (``id(request) -> (finish_reason, error)``)."""
    ends = {}
    for seq, slot in sched.samplers:
        if seq.constrained:
            end = grammar.advance(seq.matcher, int(tokens[slot]))
            if end is not None:
                ends[id(seq)] = end
    return ends


def step_outputs(
    sched: SchedulerOutput,
    result,
    ends: dict[int, tuple],
    scheduler: Scheduler,
    counters: collections.Counter,
    token_texts: logprob_host.TokenTexts,
) -> list[RequestOutput]:
    """Steps 2-4 of the module doc for one step's ``result`` (``ends``: from
    :func:`advance_grammars`); counts the tokens in ``counters``."""
    if sched.prompt_logprob_rows:
        logprob_host.read_prompt(sched.prompt_logprob_rows, result.prompt_top, token_texts)
    if not sched.samplers:
        return []
    now = time.monotonic()
    results: list[tuple[Request, RequestOutput]] = []
    emitted = speculator.emitted(sched, result, scheduler, counters)
    for (seq, tokens, logprobs), (_, slot) in zip(emitted, sched.samplers):
        seq.inflight -= 1
        if seq.finished:
            continue  # finished by an earlier step's token, or aborted
        if seq.first_token_time is None:
            seq.first_token_time = now
        # Several tokens after a block of steps or a speculative dispatch.
        done, new = stop_checker.append_run(seq, tokens, logprobs)
        if seq.params.logprobs is not None:
            for token, logprob in zip(tokens[:new], logprobs[:new]):
                logprob_host.read_token(seq, slot, token, logprob, result.top, token_texts)
        end = ends.get(id(seq))
        if end is not None and (done is None or end[0] == "error"):
            done, seq.error = (end[0], None), end[1]  # the grammar ended (or failed)
        if done is not None:
            scheduler.finish(seq, *done)
        out = request_output.step_output(seq, new)
        if out is not None:
            results.append((seq, out))
        counters["tokens"] += new
    return merge_outputs(results)  # n > 1: one output per request, not per child
