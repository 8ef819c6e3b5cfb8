"""The narrow interface between an engine and its front ends (``LLM``, ``serving/``).

:class:`EngineClient` is what the offline ``LLM`` and the servers' engine thread drive;
``LLMEngine`` implements it, and so does the data-parallel ``ReplicaRouter``. Front ends never
read scheduler internals: what they report comes from :meth:`EngineClient.stats`, a typed
snapshot. A failed step is reported as :class:`StepFailed` *after* the engine has recovered
(fresh device state), naming the requests that failed with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from jbatch.engine.config import EngineConfig
from jbatch.engine.tenants import TenantStats
from jbatch.models.config import ModelConfig
from jbatch.outputs import OutputKind, RequestOutput
from jbatch.sampling_params import SamplingParams
from jbatch.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine (or of all replicas behind a router, summed)."""

    running: int  # requests holding a slot
    waiting: int  # requests waiting for one (new, preempted or swapped out)
    total_slots: int
    pages_used: int  # KV pages referenced by running requests
    pages_cached: int  # unreferenced pages kept by the prefix cache
    pages_total: int
    prefix_cache_hits: int  # pages found in the prefix cache
    prefix_cache_queries: int  # pages looked up
    preemptions: int
    steps: int  # engine steps dispatched
    dispatches: int  # jitted device calls (1 per step, plus one per swap)
    tokens: int  # tokens generated
    prompt_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    decode_rows: int  # decode rows used, summed over steps
    swap_outs: int
    steps_while_queued: int  # steps taken while a request waited for a slot
    busy_slots_while_queued: int  # busy slots summed over those steps
    host_seconds: float  # wall time in ``step()``, device waits included
    device_wait_seconds: float  # time ``step()`` blocked on device results
    constrained_steps: int  # steps that read the previous step first (structured output)
    bitmask_seconds: float  # host time filling token bitmasks (structured output)
    # Host time inside the jitted calls that launch steps (JAX/XLA preparing each execution:
    # its arguments, results and buffers); part of ``host_only_seconds``.
    dispatch_seconds: float = 0.0
    # Requests whose last token is in a dispatched step: their slot went to the next step's
    # admissions, their output is not read yet (scheduler.py, "Retirement"). Not in ``running``
    # or ``waiting``; a front end counting its own queue adds them to ``running``.
    retiring: int = 0
    # Speculative decoding: speculative steps, requests that had proposals in them (summed
    # over steps), tokens proposed, proposals accepted.
    spec_steps: int = 0
    spec_groups: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Blocks of decode steps the device ended before their planned count on a stop token.
    blocks_ended_early: int = 0
    # Steps that prefilled prompts and ran on as a block of decode steps (admission blocks,
    # ``decode_block.py``).
    admission_blocks: int = 0
    # Per tenant (every tenant seen since the scheduler was built): served tokens, queue, slots.
    tenants: dict[str, TenantStats] = dataclasses.field(default_factory=dict)

    @property
    def host_only_seconds(self) -> float:
        """Host work in ``step()``: its wall time minus the time it waited for the device."""
        return self.host_seconds - self.device_wait_seconds

    @property
    def spec_acceptance_rate(self) -> float:
        """Fraction of proposed tokens the target accepted."""
        proposed = self.spec_proposed_tokens
        return self.spec_accepted_tokens / proposed if proposed else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a request got per speculative step it had proposals in (accepted + 1)."""
        groups = self.spec_groups
        return (self.spec_accepted_tokens + groups) / groups if groups else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    @classmethod
    def total(cls, parts: Sequence[EngineStats]) -> EngineStats:
        """Field-wise sum (replicas behind one router); tenants are summed tenant by tenant."""
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "tenants"]
        tenants: dict[str, TenantStats] = {}
        for part in parts:
            for name, t in part.tenants.items():
                tenants[name] = tenants[name] + t if name in tenants else t
        summed = {name: sum(getattr(p, name) for p in parts) for name in fields}
        return cls(**summed, tenants=tenants)


class StepFailed(RuntimeError):
    """``step()`` failed; the engine has already rebuilt its device state. ``failed`` lists the
    requests that failed with it (finished as ``"error"``); requests the device never saw stay
    queued. ``outputs`` holds what other replicas produced in the same call."""

    def __init__(self, failed: list[str], outputs: list[RequestOutput], cause: BaseException):
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.failed, self.outputs, self.cause = failed, outputs, cause


@runtime_checkable
class EngineClient(Protocol):
    model_cfg: ModelConfig
    cfg: EngineConfig
    tokenizer: Tokenizer | None
    eos_ids: frozenset[int]

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
        tenant: str | None = None,
    ) -> str:
        """Validate and queue a request (``ValueError`` naming the bad field); its id.
        ``tenant``: who it belongs to (None: ``"default"``; see ``jbatch/engine/tenants.py``)."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its slot and pages are free for the next step."""
        ...

    def forget(self, request_id: str) -> bool:
        """Drop a finished request's record; False if it is still unfinished."""
        ...

    def step(self) -> list[RequestOutput]:
        """One engine step; raises :class:`StepFailed` (engine recovered) on failure."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def reset(self, requeue_waiting: bool = True) -> list[str]:
        """Fresh device state and scheduler; returns the ids of the requests dropped."""
        ...
