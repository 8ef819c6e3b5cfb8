"""ParentRequest: a request with ``n > 1`` completions, run as ``n`` child sequences.

Each child is an ordinary :class:`Request` (its own slot, pages, counters, detokenizer and stop
checks) with ``parent`` set and ``index`` = its completion's index. What makes them a family:

* **Seeds**: child ``i`` samples with ``(seed + i) % 2**32``, ``seed`` being the request's seed
  (given, or drawn once for the whole request). So child 0 is the request itself, child ``i``
  equals the same prompt run alone with ``n=1, seed=seed + i``, and greedy children are equal.
* **Prompt pages**: the full pages among the prompt's first ``len(prompt) - 1`` tokens are
  computed once, by whichever child is admitted first, and the others take them by reference
  (:func:`sibling_prompt_pages`; refcounted like prefix-cache hits, with or without the prefix
  cache). A child still computes the rest of the prompt — the last, partial page, which it
  appends to — because every sequence writes only pages of its own. A child whose sibling is
  computing those pages right now waits for it rather than computing them a second time.
  Children with a ``repetition_penalty`` do not share: the penalty's prompt mask is built on the
  device from the prompt tokens that pass through the step, so each child computes the whole
  prompt (presence and frequency penalties count outputs only, so they share).
* **Outputs** (:func:`merge_outputs`): one :class:`RequestOutput` per request and step, whose
  ``outputs`` hold the deltas of the children that got tokens (``index`` 0..n-1); with
  ``OutputKind.FINAL``, one output with all ``n`` completions once every child has finished.
  The request is ``finished`` when all its children are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from jbatch.engine.request import Request, RequestStatus
from jbatch.outputs import CompletionOutput, OutputKind, RequestOutput
from jbatch.sampling_params import SEED_LIMIT


def child_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request seeded with ``seed``."""
    return (seed + index) % SEED_LIMIT


def shares_prompt_pages(seq: Request) -> bool:
    """Whether ``seq`` may start from pages another sequence computed for it: not with a
    repetition penalty, whose prompt mask needs every prompt token to pass through the step."""
    return seq.params.repetition_penalty == 1.0


@dataclasses.dataclass(eq=False)
class ParentRequest:
    request_id: str
    children: list[Request]
    output_kind: OutputKind
    finals: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)

    @classmethod
    def fan_out(cls, seq: Request, n: int, per_child: Callable[[], dict]) -> ParentRequest:
        """``n`` children of the request ``seq`` (which becomes child 0); ``per_child()`` gives
        the fields each child needs its own of (detokenizer, grammar matcher)."""
        fresh = {  # a new request: every list field is still empty; each child gets its own
            f.name: f.default_factory
            for f in dataclasses.fields(Request)
            if f.default_factory is not dataclasses.MISSING
        }
        children = [seq] + [
            dataclasses.replace(
                seq,
                seed=child_seed(seq.seed, i),
                index=i,
                **{name: make() for name, make in fresh.items()},
                **per_child(),
            )
            for i in range(1, n)
        ]
        parent = cls(seq.request_id, children, seq.output_kind)
        for child in children:
            child.parent = parent
        return parent

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def child_keys(self) -> list[tuple[str, int]]:
        """The children's keys in ``LLMEngine.requests`` (never equal to a user's string id)."""
        return [(self.request_id, c.index) for c in self.children]

    def merge(self, outs: list[RequestOutput]) -> RequestOutput | None:
        """This step's outputs of some children -> the request's (None: FINAL, still running)."""
        finished = self.finished
        if self.output_kind is OutputKind.FINAL:
            for out in outs:
                self.finals[out.outputs[0].index] = out.outputs[0]
            if not finished:
                return None
            completions = [self.finals[i] for i in range(len(self.children))]
        else:
            completions = [c for out in outs for c in out.outputs]
        error = next((o.error for o in outs if o.error), None)
        return dataclasses.replace(
            outs[-1], outputs=completions, finished=finished, metrics=self.metrics(), error=error
        )

    def metrics(self) -> dict[str, float]:
        first = [c.first_token_time for c in self.children if c.first_token_time is not None]
        metrics = {
            "arrival_time": self.children[0].arrival_time,
            "num_preemptions": sum(c.num_preemptions for c in self.children),
        }
        if first:
            metrics["first_token_time"] = min(first)
        return metrics


def merge_outputs(pairs: Iterable[tuple[Request, RequestOutput]]) -> list[RequestOutput]:
    """One output per request: children's outputs are merged into their parent's (in the order
    of each request's first output)."""
    results: list[RequestOutput | ParentRequest] = []
    groups: dict[int, list[RequestOutput]] = {}
    for seq, out in pairs:
        parent = seq.parent
        if parent is None:
            results.append(out)
            continue
        if id(parent) not in groups:
            groups[id(parent)] = []
            results.append(parent)
        groups[id(parent)].append(out)
    merged = []
    for item in results:
        if isinstance(item, ParentRequest):
            out = item.merge(groups[id(item)])
            if out is None:
                continue
            item = out
        merged.append(item)
    return merged


def whole_families(seqs: list[Request]) -> list[Request]:
    """The sequences of ``seqs`` whose siblings are all in ``seqs`` too (after a failed step a
    request is kept only if none of its children is dropped)."""
    kept = {id(s) for s in seqs}
    return [s for s in seqs if s.parent is None or all(id(c) in kept for c in s.parent.children)]


def sibling_prompt_pages(seq: Request, page_size: int, fresh: set[int]) -> list[int] | None:
    """Prompt pages a running sibling of ``seq`` computed that ``seq`` may take by reference:
    ``[]`` when none can give them (``seq`` computes its prompt itself), ``None`` when a
    sibling is computing them now (``seq`` should wait). ``fresh``: ids of sequences swapped in
    this step (their pages are written only after it)."""
    if seq.parent is None or not shares_prompt_pages(seq):
        return []
    k = (len(seq.prompt_ids) - 1) // page_size
    if k == 0:
        return []
    busy = False
    for sib in seq.parent.children:
        if sib is seq or sib.status is not RequestStatus.RUNNING or id(sib) in fresh:
            continue
        if not shares_prompt_pages(sib):
            continue
        if sib.num_computed >= k * page_size and len(sib.pages) >= k:
            return sib.pages[:k]
        busy = True  # prefilling the prompt now
    return None if busy else []
