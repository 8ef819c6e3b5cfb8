"""How many prompt rows a step plans for (``Scheduler.schedule``'s row cap).

A step's prompt region is padded up to a prefill bucket (``buckets.py``), and its cost grows
with the bucket, not with the rows used: on the 30-layer SmolLM2-135M shape each bucket row
costs ~1.3 ms on this CPU, padding included. Planning greedily (as many rows as the budget
holds) put 70 wanted rows into the 256-row bucket; in a long-tail run 49% of the prompt rows
computed were padding. So the scheduler first estimates the rows it *could* schedule —
running prompts' remaining chunks, then the waiting requests that free slots would admit,
each rounded up to ``block_q`` — and caps the step at the nearest bucket
(``buckets.fit_prompt_rows``): what does not fit waits for the next step's chunk.

The estimate is an upper bound (prefix-cache hits, pacing and free pages can only lower what
is scheduled), so a cap never leaves a step with less prompt work than it could have run in
its bucket: at worst the step is as padded as without the cap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from jbatch.engine import buckets
from jbatch.engine.config import EngineConfig
from jbatch.engine.request import Request, RequestStatus


def wanted_rows(
    cfg: EngineConfig, running: Iterable[Request], waiting, free_slots: int, step: int
) -> int:
    """Prompt rows this step could use, up to the largest bucket: the running prompts' rest,
    then the first ``free_slots`` admissible waiting requests' prompts (``waiting``: the
    scheduler's queue; ``step``: the scheduler's step number, to skip the just-preempted)."""
    top = buckets.prefill_buckets(cfg)[-1]
    want = 0
    for seq in running:
        if seq.status is RequestStatus.RUNNING and seq.prefilling:
            want += buckets.block_rows(cfg, len(seq.prefill_ids) - seq.num_computed)
            if want >= top:
                return top
    if free_slots == 0 or not len(waiting):
        return want
    with contextlib.closing(waiting.in_order()) as queue:
        for seq in queue:
            if free_slots == 0 or want >= top:
                break
            if seq.held_back(step):
                continue  # the admission pass skips these too
            free_slots -= 1
            if not seq.swapped_pages:  # a swap-in computes nothing; ``start`` prefills these
                want += buckets.block_rows(cfg, seq.num_tokens)
    return min(want, top)


def row_cap(
    cfg: EngineConfig, running, waiting, free_slots: int, step: int, budget: int, decodes: int
) -> int:
    """The prompt rows to schedule this step, beside its ``decodes`` decode rows, at most
    (module doc)."""
    wanted = wanted_rows(cfg, running, waiting, free_slots, step)
    wanted = min(wanted, buckets.region_rows(cfg, buckets.block_rows(cfg, budget)))
    return buckets.fit_prompt_rows(cfg, max(wanted, 1), decodes)
