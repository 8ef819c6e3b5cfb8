"""Request: the host-side record of one request as it moves through the engine."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jbatch.engine.page_allocator import chain_hash
from jbatch.engine.state import decodes
from jbatch.engine.tenants import DEFAULT_TENANT
from jbatch.outputs import OutputKind
from jbatch.sampling_params import SamplingParams
from jbatch.tokenizer import IncrementalDetokenizer

_NO_LIMIT = float("inf")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HANDED_OVER = "handed_over"  # prefill role: swapped out for a decode engine (handover.py)
    # Its last token is in a dispatched step: the slot went to the next step's admissions, the
    # pages stay until the token is read (scheduler.py, "Retirement").
    RETIRING = "retiring"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One request. Counters mirror the device state *as of the last dispatched step*."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: min(params.max_tokens, max_seq_len - prompt length)
    seed: int  # resolved: params.seed or a random one
    eos_ids: frozenset[int]
    prompt: str | None = None
    arrival_time: float = 0.0
    priority: int = 0
    tenant: str = DEFAULT_TENANT  # who the request belongs to (tenants.py; fair share)
    detokenizer: IncrementalDetokenizer | None = None
    output_kind: OutputKind = OutputKind.DELTA
    matcher: Any = None  # llguidance.LLMatcher of a structured request (engine/grammar.py)
    error: str | None = None  # why the request failed (finish reason "error")
    # n > 1: the request's ParentRequest (parent_request.py) and this completion's index.
    parent: object | None = dataclasses.field(default=None, repr=False)
    index: int = 0

    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Logprobs (``logprob_host.py``): per output token (``params.logprobs`` set); per prompt
    # token (``params.prompt_logprobs`` set: None for the first), the next one to ask the
    # device for, and whether they were sent.
    top_logprobs: list[dict] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None
    prompt_logprobs_asked: int = 1
    prompt_logprobs_sent: bool = False
    # Detokenized output not streamed yet: bounded by the longest stop string (held back in
    # case it grows into one) plus the newest token's text. Streamed text is not kept, except
    # for FINAL outputs, whose chunks are joined once at the end.
    pending_text: str = ""
    text_chunks: list[str] = dataclasses.field(default_factory=list)
    # Host mirror of the device counters, advanced when a step is *scheduled*.
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # prompt (+ outputs on resume)
    num_computed: int = 0  # tokens whose K/V the dispatched steps write (device seq_lens)
    num_sampled: int = 0  # samples the dispatched steps draw (device num_generated)
    inflight: int = 0  # dispatched steps that sample for this sequence, not yet processed
    # Proposals a dispatched, unprocessed speculative step may accept beyond ``num_computed``
    # (so the device's seq_lens is at most num_computed + spec_pending; pages cover it).
    spec_pending: int = 0
    admitted_at: int = -1  # admission counter (preemption picks the most recent)
    arrival_order: int = 0  # FCFS tie-break among equal effective priorities
    waiting_since: int = 0  # scheduler step at which the request arrived (its age counts from it)
    first_scheduled_step: int | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    num_preemptions: int = 0
    preempted_at: int = -1  # scheduler step of the last preemption
    swapped: object | None = None  # host copy of pages + slot rows while swapped out
    swapped_pages: int = 0  # pages the swapped copy holds
    swap_shared_pages: int = 0  # of those, prefix-cache hits the swap-in shares (not written)
    first_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Names of the stream's full pages (``hash_pages``), and how many of this admission's
    # pages are registered in the prefix cache.
    page_hash_chain: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    registered_pages: int = 0
    # Speculative decoding: the stream as a numpy buffer (``ngram_proposer.TokenStream``).
    token_stream: Any = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def uses_penalties(self) -> bool:
        return self.params.uses_penalties

    @property
    def constrained(self) -> bool:
        """A running structured-output request: its grammar matcher masks what it samples."""
        return self.matcher is not None and not self.finished

    @property
    def text_at_end(self) -> bool:
        """A FINAL request without stop strings: nothing reads its text before it ends, so its
        tokens are detokenized once then (``stop_checker.text_to_emit``), not one by one."""
        return self.output_kind is OutputKind.FINAL and not self.params.stop

    @property
    def speculates(self) -> bool:
        """Whether speculative steps propose tokens for this request: it did not opt out, and
        nothing it samples depends on the previous token on the host or the device (a grammar,
        penalties) or asks for more than one row's top logprobs."""
        p = self.params
        return p.speculative and not (self.host_per_token or p.uses_penalties)

    @property
    def host_per_token(self) -> bool:
        """Whether each token needs the host before the next is sampled: a grammar's mask, or
        top logprobs read per row (such requests neither speculate nor run in blocks)."""
        return self.matcher is not None or self.params.logprobs is not None

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prefill_ids)

    @property
    def can_decode(self) -> bool:
        """``EngineState.decode_mask``'s rule for this running request (room is left by
        construction: ``max_tokens`` is resolved to fit ``max_seq_len``)."""
        done, prefill = self.num_computed, len(self.prefill_ids)
        return decodes(True, done, prefill, self.num_sampled, self.max_tokens, _NO_LIMIT)

    def held_back(self, step: int) -> bool:
        """Not admissible at scheduler step ``step``: still owed tokens from a step in flight,
        or evicted at this very step."""
        return bool(self.inflight) or self.preempted_at == step

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the sequence's token stream."""
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of the stream prompt + outputs (without concatenating both)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def hash_pages(self, limit: int, page_size: int) -> int:
        """Extend ``page_hash_chain`` over the full pages among the first ``limit`` tokens of the
        stream and return their count. Each page is hashed once per request, from its parent's
        name, so the cost is O(new pages), not O(length)."""
        chain = self.page_hash_chain
        for start in range(len(chain) * page_size, limit - page_size + 1, page_size):
            parent = chain[-1] if chain else b""
            chain.append(chain_hash(parent, self.tokens(start, start + page_size)))
        return limit // page_size

    def resume(self, slot: int, admitted_at: int, pages: list[int]) -> None:
        """Re-admit a swapped-out sequence into fresh ``pages``; its counters are unchanged."""
        self.status = RequestStatus.RUNNING
        self.slot, self.admitted_at, self.pages = slot, admitted_at, list(pages)
        self.swapped_pages = self.registered_pages = 0

    def start(self, slot: int, admitted_at: int, cached_pages: list[int], page_size: int) -> None:
        """Admit into ``slot``: prefill the prompt plus any outputs from before a preemption,
        starting after the ``cached_pages`` found in the prefix cache."""
        self.status = RequestStatus.RUNNING
        self.slot = slot
        self.admitted_at = admitted_at
        self.prefill_ids = self.prompt_ids + self.output_ids
        self.pages = list(cached_pages)
        self.registered_pages = len(cached_pages)  # found in the cache: registered already
        self.num_computed = self.num_cached_tokens = len(cached_pages) * page_size
        self.num_sampled = len(self.output_ids)
