"""LLMEngine: requests in, token streams out, one device dispatch per ``step()`` call.

Data flow of one ``step()``:
1. The scheduler plans step N from the host mirror of the device state (admissions, prompt
   chunks, decodes, pages; preemptions if the pool is full).
2. The batch builder writes the plan into one packed input; step N is dispatched as one
   program (slots freed since the last step are released, new requests inserted, the model
   runs) — asynchronously: JAX returns at once while the device works, and the copy of the
   step's packed result to the host is started right away. Swaps, on the steps that have any,
   are separate programs before (out) and after (in) it.
3. Only then are step N-1's sampled tokens read (the device is already busy with step N), so
   detokenizing, stop checks and output building overlap device work. Finished requests give
   their slot and pages back to the scheduler immediately, for step N+1.
4. The outputs — deltas, one ``RequestOutput`` per request that got tokens (O(1) host work per
   token) — are returned to the caller.

A token sampled in step N for a sequence that step N-1 finished (found only in step 3) is
dropped: the cost of overlap is at most one wasted row per finishing sequence.

Structured output (``engine/grammar.py``): when step N-1 sampled for a running request with a
grammar, step N is planned and packed, then step N-1's tokens are read and fed to the grammar
matchers, then step N's token bitmask is filled and step N is dispatched; step N-1's text and
stop checks are done after that dispatch, as usual. With ``structured_overlap`` step N's
forward is dispatched *before* waiting for step N-1, and its sampling after the mask is filled
(``engine/split_step.py``): the device runs the forward meanwhile.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence as Seq

import numpy as np

from jbatch.engine import (
    batch_builder,
    logprob_host,
    request_output,
    snapshot,
    speculator,
    step_results,
)
from jbatch.engine.buckets import pick_handover_bucket
from jbatch.engine.config import EngineConfig
from jbatch.engine.draft_proposer import DRAFT_PARAMS, load_draft
from jbatch.engine.engine_core import EngineCore
from jbatch.engine.interface import EngineStats, StepFailed
from jbatch.engine.parent_request import ParentRequest, merge_outputs, whole_families
from jbatch.engine.request import Request, RequestStatus
from jbatch.engine.request_intake import RequestIntake
from jbatch.engine.scheduler import Scheduler
from jbatch.engine.scheduler_output import SchedulerOutput
from jbatch.engine.sizing import resolve
from jbatch.engine.tenants import check_tenant
from jbatch.models.config import ModelConfig
from jbatch.models.llama import unstack_layers
from jbatch.models.lm_head import with_cpu_head
from jbatch.models.quant import ensure_quantized
from jbatch.outputs import OutputKind, RequestOutput
from jbatch.sampling_params import SamplingParams
from jbatch.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Integer counters of ``EngineStats`` that the engine keeps itself.
_COUNTERS = (
    "steps", "dispatches", "tokens", "prompt_tokens", "decode_rows", "swap_outs",
    "steps_while_queued", "busy_slots_while_queued", "constrained_steps",
    "spec_steps", "spec_groups", "spec_proposed_tokens", "spec_accepted_tokens",
    "blocks_ended_early", "admission_blocks",
)  # fmt: skip


def _constrained(sched: SchedulerOutput) -> bool:
    """Whether a step sampled for a running structured-output request."""
    return any(seq.constrained for seq, _ in sched.samplers)


class LLMEngine:
    """Implements :class:`jbatch.engine.interface.EngineClient` on one device set."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        params: dict,
        cfg: EngineConfig,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Seq[int] = (),
        warmup: bool = True,
        core=None,
    ):
        """``core`` replaces the jitted device functions (tests pass a ``MockCore``). Sizes left
        open in ``cfg`` are taken from the model (:func:`jbatch.engine.sizing.resolve`)."""
        cfg = resolve(cfg, model_cfg)
        self.model_cfg, self.cfg, self.tokenizer = model_cfg, cfg, tokenizer
        self.intake = RequestIntake(cfg, model_cfg.vocab_size, tokenizer, frozenset(eos_token_ids))
        draft = None
        if cfg.speculative == "draft" and core is None:  # engine/draft_proposer.py
            draft = load_draft(cfg.speculative_model, model_cfg, cfg, tokenizer)
        draft_cfg = None if draft is None else draft.cfg
        self.core = EngineCore(model_cfg, cfg, draft_cfg=draft_cfg) if core is None else core
        if params is not None and getattr(self.core, "mesh", None) is None:
            params = ensure_quantized(params, cfg.weight_quant)  # if loaded as floats
            params = unstack_layers(params)  # one device: per-layer arrays, read in place
            params = with_cpu_head(params)  # XLA:CPU: an [E, V] LM head (lm_head.py)
        if draft is not None:
            params = {**params, DRAFT_PARAMS: draft.params}
        self.params = params
        self.state = self.core.init_state()
        self._swap_compiled = cfg.swaps
        self.handed_over: list[Request] = []  # prefill role: swapped out for a decode engine
        if warmup:
            self.state = self.core.warmup(params, self.state)
        self.scheduler = Scheduler(cfg)
        # Requests by id; the children of an n > 1 request by (id, index), its ParentRequest
        # in ``parents``.
        self.requests: dict[str | tuple[str, int], Request] = {}
        self.parents: dict[str, ParentRequest] = {}
        self._inflight: collections.deque[tuple[SchedulerOutput, object]] = collections.deque()
        self._ids = itertools.count()
        self._failures = 0  # consecutive failed steps
        self._last_result_at = 0.0  # when the last step's result was read (perf_counter)
        self.counters: collections.Counter = collections.Counter()  # see EngineStats
        self._token_texts = logprob_host.TokenTexts(tokenizer)  # Logprob.decoded_token
        self._speculator = speculator.Speculator(cfg) if cfg.speculative else None

    @property
    def eos_ids(self) -> frozenset[int]:
        """The token ids that end a request (``RequestIntake.eos_ids``, the one copy)."""
        return self.intake.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.intake.eos_ids = frozenset(ids)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
        tenant: str | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError naming the bad field and value.
        ``output_kind``: stream deltas every step (DELTA) or one whole output at the end.
        ``tenant``: who the request belongs to (None: ``"default"``), for fair share."""
        params = params or SamplingParams()
        if self.cfg.role == "decode":
            raise ValueError("a role='decode' engine takes handed-over requests only")
        tenant = check_tenant(tenant)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests or request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq, per_child = self.intake.request(
            request_id, prompt, params, priority=priority,
            arrival_time=arrival_time, output_kind=output_kind, tenant=tenant,
        )  # fmt: skip
        if params.n == 1:
            self.requests[request_id] = seq
            self.scheduler.add(seq)
            return request_id
        parent = ParentRequest.fan_out(seq, params.n, per_child)
        self.parents[request_id] = parent
        for key, child in zip(parent.child_keys(), parent.children):
            self.requests[key] = child
            self.scheduler.add(child)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its slot and pages are free for the next step."""
        parent = self.parents.get(request_id)
        for seq in parent.children if parent else [self.requests.get(request_id)]:
            if seq is not None and not seq.finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or bool(self._inflight)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step (see the module doc). On failure the engine rebuilds its device state
        and raises :class:`StepFailed` with an ``"error"`` output for each request that failed."""
        t0 = time.perf_counter()
        try:
            outputs = self._step()
            self._failures = 0
        except Exception as e:
            self._failures += 1
            log.exception("engine step failed; rebuilding the device state")
            # Requests the device never saw stay queued, unless steps keep failing.
            dropped = self._reset(requeue_waiting=self._failures < 2, reason="error")
            error = f"engine step failed: {type(e).__name__}: {e}"
            outputs = merge_outputs((s, request_output.error_output(s, error)) for s in dropped)
            raise StepFailed([o.request_id for o in outputs], outputs, e) from e
        finally:
            self.counters["host_seconds"] += time.perf_counter() - t0
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, early = [], []
        spec = self._speculation_wanted()
        # While a speculative step runs the host does not know how far it gets: only another
        # speculative step, with pages for the worst case, is planned meanwhile
        # (engine/speculator.py); anything else waits for its result.
        last = self._inflight[-1][0] if self._inflight else None
        spec_running = last is not None and last.drafts is not None
        # A block of decode steps in flight emits several tokens the device does not keep
        # for the next speculative dispatch's stream (spec_block.py): it lands first too.
        block_running = last is not None and last.drafts is None and last.steps > 1
        overlaps = spec and self._speculator.overlaps(self.scheduler)
        # A block that may have ended early on the device lands first: that gives planned
        # tokens back (decode_block.py). So does one whose requests may stop early (EOS, a
        # stop token or string) while requests queue, arrived since it was planned too:
        # planned blind, a request that stopped would hold its slot for another whole block.
        stops = block_running and (
            last.idle_budget is not None
            or (bool(self.scheduler.waiting) and self.scheduler.may_stop_early())
        )
        if (spec_running and not overlaps) or (block_running and spec) or stops:
            outputs += self.drain()
            spec = self._speculation_wanted()
        lockstep = bool(self._inflight) and _constrained(self._inflight[-1][0])
        if lockstep:
            while len(self._inflight) > 1:
                outputs += self._process(*self._inflight.popleft())

        def feed_grammars() -> None:
            # A grammar needs the token its request sampled in the step still in flight: once
            # the next step is planned and packed, wait for that step and feed its tokens to
            # the matchers; then the next step's bitmask can be filled and the step dispatched.
            # The rest of its processing (text, stop checks) overlaps the next step.
            if lockstep and not early:
                prev, handle = self._inflight.popleft()
                result = self._fetch(prev, handle)
                early.append((prev, result, step_results.advance_grammars(prev, result.tokens)))
                self.counters["constrained_steps"] += 1

        steps = self.scheduler.block_steps()  # > 1: a block of (speculative) steps
        sched = self.scheduler.schedule(self._speculator.propose if spec else None, steps)
        split = lockstep and self.cfg.structured_overlap
        dispatched = self._dispatch(sched, feed_grammars, split)
        feed_grammars()  # if nothing was dispatched
        outputs += self._outputs(*early[0]) if early else []
        keep = 1 if (dispatched and self.cfg.async_scheduling) else 0
        while len(self._inflight) > keep:
            outputs += self._process(*self._inflight.popleft())
        if not (dispatched or sched.swap_ins or self._inflight) and self.scheduler.running:
            self.scheduler.break_deadlock()  # prompts stuck without pages: free the newest
        if self.cfg.debug_checks:
            self.scheduler.check_invariants()
        return outputs

    def _speculation_wanted(self) -> bool:
        return self._speculator is not None and self._speculator.wanted(self.scheduler)

    def _dispatch(
        self, sched: SchedulerOutput, before_step=lambda: None, split: bool = False
    ) -> bool:
        """Device order: swap-outs (before any reuse of their slots and pages), then the one
        step program (releases, inserts, the model step), then swap-ins (a swapped-in request
        takes part from the next step on). Returns whether the step had model work."""
        core, counters = self.core, self.counters
        for seq, slot, pages in sched.swap_outs:
            self.state, saved = core.swap_out(self.state, slot, self._pages(pages))
            seq.swapped = core.to_host(saved)
            counters["swap_outs"] += 1
            counters["dispatches"] += 1
        for seq, slot, pages in sched.handovers:  # stays on the device: handover.take_ready
            n = pick_handover_bucket(self.cfg, len(pages))
            self.state, seq.swapped = core.swap_out(self.state, slot, self._pages(pages), n)
            self.handed_over.append(seq)
            counters["dispatches"] += 1
        work = not sched.empty
        # Releases may wait for the next step (a released slot is never listed to decode), but
        # must land before a swap-in reuses their slot; inserts go out now.
        if work or sched.inserts or (sched.releases and sched.swap_ins):
            if sched.drafts is not None:  # a speculative step (engine/spec_step.py)
                inp = batch_builder.build_spec_input(self.cfg, core, sched)
                before_step()
                handle = self._launch(core.step, self.params, self.state, inp, self._bitmask(sched))
            elif split:  # the forward runs while the previous tokens reach the grammars
                inp = batch_builder.build_step_input(self.cfg, core, sched)
                forwarded = self._launch(core.forward, self.params, self.state, inp)
                before_step()
                handle = self._launch(core.sample, self.state, forwarded, self._bitmask(sched))
            else:
                inp = batch_builder.build_step_input(self.cfg, core, sched)
                before_step()
                handle = self._launch(core.step, self.params, self.state, inp, self._bitmask(sched))
            sched.dispatched_at = time.perf_counter()
            self._inflight.append((sched, handle))
            counters["dispatches"] += 1
        elif sched.releases:
            self.scheduler.pending_releases += sched.releases
        for seq, slot, pages in sched.swap_ins:
            saved = core.to_device(seq.swapped)
            shared = seq.swap_shared_pages  # prefix-cache hits: shared, not written
            self.state = core.swap_in(self.state, slot, self._pages(pages), saved, shared)
            seq.swapped = None
            counters["dispatches"] += 1
        if not work:
            return False
        if sched.drafts is None:  # a speculative dispatch's steps: those it ran (speculator)
            counters["steps"] += sched.steps
        counters["decode_rows"] += len(sched.decodes) * sched.steps
        counters["admission_blocks"] += int(sched.admission_block)
        if self.scheduler.waiting:  # slot utilization while requests queue for a slot
            counters["steps_while_queued"] += 1
            counters["busy_slots_while_queued"] += len(self.scheduler.running)
        counters["prompt_tokens"] += sum(len(c.token_ids) for c in sched.chunks)
        return True

    def _launch(self, call, *args):
        """``self.state, out = call(*args)`` (a core call that launches device work); its host
        time is counted as ``dispatch_seconds``. Returns ``out``."""
        t0 = time.perf_counter()
        self.state, out = call(*args)
        self.counters["dispatch_seconds"] += time.perf_counter() - t0
        return out

    def _bitmask(self, sched: SchedulerOutput) -> np.ndarray | None:
        """The step's token bitmask, None when no constrained request samples in it."""
        rows = [(seq.matcher, slot) for seq, slot in sched.samplers if seq.constrained]
        if not rows:
            return None
        t0 = time.perf_counter()
        mask = self.intake.grammars.bitmask(rows, self.cfg.max_slots)
        self.counters["bitmask_seconds"] += time.perf_counter() - t0
        return mask

    def _pages(self, pages: list[int]) -> np.ndarray:
        padded = self.core.unused_pages()
        padded[: len(pages)] = pages
        return padded

    def _process(self, sched: SchedulerOutput, handle) -> list[RequestOutput]:
        result = self._fetch(sched, handle)
        return self._outputs(sched, result, step_results.advance_grammars(sched, result.tokens))

    def _outputs(self, sched: SchedulerOutput, result, ends: dict) -> list[RequestOutput]:
        args = (self.scheduler, self.counters, self._token_texts)
        return step_results.step_outputs(sched, result, ends, *args)

    def _fetch(self, sched: SchedulerOutput, handle):
        t0 = time.perf_counter()
        result = self.core.fetch(handle)
        done = time.perf_counter()
        self.counters["device_wait_seconds"] += done - t0
        pacer = self.scheduler.pacer
        if pacer is not None and sched.steps == 1:  # it ran from its dispatch or the last result
            took = done - max(sched.dispatched_at, self._last_result_at)
            pacer.observe(took, sched.paced_pairs, len(sched.decodes))
        self._last_result_at = done
        return result

    def stats(self) -> EngineStats:
        """A typed snapshot of the engine (what front ends and metrics read)."""
        sched, alloc, c = self.scheduler, self.scheduler.allocator, self.counters
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            total_slots=self.cfg.max_slots,
            pages_used=alloc.num_used,
            pages_cached=alloc.num_cached,
            pages_total=alloc.num_pages,
            prefix_cache_hits=alloc.hits,
            prefix_cache_queries=alloc.queries,
            preemptions=sched.num_preemptions,
            **{name: c[name] for name in _COUNTERS},
            host_seconds=c["host_seconds"],
            device_wait_seconds=c["device_wait_seconds"],
            bitmask_seconds=c["bitmask_seconds"],
            dispatch_seconds=c["dispatch_seconds"],
            retiring=len(sched.retiring),
            tenants=sched.ledger.snapshot(s.tenant for s in sched.running.values()),
        )

    POLICY_FIELDS = (
        "enable_prefix_caching", "aging_steps", "preemption_mode", "scheduling_policy",
        "tenant_weights", "prefill_pacing",
    )  # fmt: skip

    def set_policies(self, **policies) -> None:
        """Change scheduling policies (``POLICY_FIELDS``) while idle; the
        compiled programs are unchanged. A fresh scheduler starts with an empty prefix cache."""
        bad = sorted(set(policies) - set(self.POLICY_FIELDS))
        if bad:
            raise ValueError(f"only {self.POLICY_FIELDS} can change at run time, got {bad}")
        if self.has_unfinished_requests():
            raise ValueError("set_policies needs an idle engine (requests are in flight)")
        new = dataclasses.replace(self.cfg, **policies)
        if new.preemption_mode != "recompute" and not self._swap_compiled:
            raise ValueError("build the engine with a swap-capable preemption_mode to switch to it")
        self.cfg, self.scheduler = new, Scheduler(new)

    def reset(self, requeue_waiting: bool = True) -> list[str]:
        """Build a fresh device state and scheduler (after a failure: the donated state may be
        gone). Requests that never reached the device are requeued (unless ``requeue_waiting``
        is False); every other unfinished request is dropped (finish reason "abort"). Returns
        the dropped request ids."""
        dropped = self._reset(requeue_waiting, "abort")
        return list(dict.fromkeys(seq.request_id for seq in dropped))  # n > 1: once

    def _reset(self, requeue_waiting: bool, reason: str) -> list[Request]:
        self.state = self.core.init_state()
        self._inflight.clear()
        self.handed_over.clear()
        old, self.scheduler = self.scheduler, Scheduler(self.cfg)
        pristine = whole_families([s for s in old.waiting if s.admitted_at < 0 and not s.inflight])
        if requeue_waiting:
            for seq in pristine:
                self.scheduler.add(seq)
        keep = {id(s) for s in pristine} if requeue_waiting else set()
        dropped = []
        for rid, seq in list(self.requests.items()):
            if not seq.finished and id(seq) not in keep:
                seq.status, seq.finish_reason = RequestStatus.FINISHED, reason
                del self.requests[rid]
                dropped.append(seq)
        self.parents = {rid: p for rid, p in self.parents.items() if not p.finished}
        return dropped

    def forget(self, request_id: str) -> bool:
        """Drop a finished request's record; False if the request is still unfinished."""
        parent = self.parents.get(request_id)
        if parent is not None:
            if not parent.finished:
                return False
            for key in parent.child_keys():
                self.requests.pop(key, None)
            del self.parents[request_id]
            return True
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            return False
        self.requests.pop(request_id, None)
        return True

    def snapshot(self, directory) -> list[RequestOutput]:
        """Save every in-flight request to ``directory`` (``engine/snapshot.py``); returns the
        outputs of the step that was in flight (deliver them). The engine keeps running."""
        return snapshot.save(self, directory)

    def restore(self, directory) -> None:
        """Continue the work saved by :meth:`snapshot` (same model and config; idle engine)."""
        snapshot.load(self, directory)

    def drain(self) -> list[RequestOutput]:
        """Wait for in-flight steps (before inspecting device state in tests); their outputs."""
        outputs = []
        while self._inflight:
            outputs += self._process(*self._inflight.popleft())
        return outputs

    def forget_finished(self) -> None:
        """Drop finished requests' records (long-running servers call this periodically)."""
        for rid in [r for r, s in self.requests.items() if s.status is RequestStatus.FINISHED]:
            del self.requests[rid]
        self.parents = {rid: p for rid, p in self.parents.items() if not p.finished}
