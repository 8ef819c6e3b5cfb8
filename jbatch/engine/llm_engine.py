"""LLMEngine: requests in, token streams out, one device step per ``step()`` call.

Data flow of one ``step()``:
1. The scheduler plans step N from the host mirror of the device state (admissions, prompt
   chunks, decodes, pages; preemptions if the pool is full).
2. Slots freed since the last step are released, new sequences inserted, and step N is
   dispatched — asynchronously: JAX returns at once while the device works.
3. Only then are step N-1's sampled tokens fetched (the device is already busy with step N), so
   detokenizing, stop checks and output building overlap device work. Finished sequences give
   their slot and pages back to the scheduler immediately, for step N+1.
4. The outputs (one ``RequestOutput`` per request that got tokens) are returned to the caller.

A token sampled in step N for a sequence that step N-1 finished (found only in step 3) is
dropped: the cost of overlap is at most one wasted row per finishing sequence.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import time
from collections.abc import Sequence as Seq

import numpy as np

from jbatch.engine import batch_builder, stop_checker
from jbatch.engine.config import EngineConfig
from jbatch.engine.core import EngineCore, StepOutput
from jbatch.engine.request import Request, RequestStatus
from jbatch.engine.scheduler import Scheduler, SchedulerOutput
from jbatch.models.config import ModelConfig
from jbatch.models.llama import unstack_layers
from jbatch.outputs import CompletionOutput, RequestOutput
from jbatch.sampling_params import SamplingParams
from jbatch.tokenizer import IncrementalDetokenizer, Tokenizer


class LLMEngine:
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
        """``core`` replaces the jitted device functions (tests pass a ``MockCore``)."""
        self.model_cfg, self.cfg, self.tokenizer = model_cfg, cfg, tokenizer
        self.eos_ids = frozenset(eos_token_ids)
        self.core = EngineCore(model_cfg, cfg) if core is None else core
        if params is not None and getattr(self.core, "mesh", None) is None:
            params = unstack_layers(params)  # one device: per-layer arrays, read in place
        self.params = params
        self.state = self.core.init_state()
        self._swap_compiled = cfg.preemption_mode != "recompute"
        if warmup:
            self.state = self.core.warmup(params, self.state)
        self.scheduler = Scheduler(cfg)
        self.requests: dict[str, Request] = {}
        self._inflight: collections.deque[tuple[SchedulerOutput, StepOutput]] = collections.deque()
        self._ids = itertools.count()
        self.stats = collections.Counter()  # steps, host_seconds, device_wait_seconds, tokens

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError naming the bad field and value."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, ids = self._prompt_ids(prompt)
        room = self.cfg.max_seq_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_seq_len={self.cfg.max_seq_len} leaves no room "
                f"to generate"
            )
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: LLMEngine runs one sequence per request (LLM fans out)"
            )
        if params.min_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} is not supported yet")
        if params.logprobs:
            raise ValueError(f"logprobs={params.logprobs}: only the sampled token's logprob (0)")
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        elif params.stop:
            raise ValueError(f"stop={params.stop!r} needs a tokenizer; this model has none")
        seq = Request(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            max_tokens=min(params.max_tokens or room, room),
            seed=secrets.randbelow(2**32) if params.seed is None else params.seed,
            eos_ids=self.eos_ids,
            prompt=prompt_text,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            detokenizer=detok,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                msg = f"prompt must be a string or a list of token ids, got {prompt!r}"
                raise ValueError(msg) from None
            if any(isinstance(t, bool) or int(t) != t for t in prompt):
                raise ValueError(f"prompt token ids must be ints, got {list(prompt)!r}")
            text = None
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary "
                f"[0, {self.model_cfg.vocab_size})"
            )
        return text, ids

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its slot and pages are free for the next step."""
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or bool(self._inflight)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        dispatched = self._dispatch(sched)
        keep = 1 if (dispatched and self.cfg.async_scheduling) else 0
        outputs = []
        while len(self._inflight) > keep:
            outputs += self._process(*self._inflight.popleft())
        if not (dispatched or sched.swap_ins or self._inflight) and self.scheduler.running:
            self.scheduler.break_deadlock()  # prompts stuck without pages: free the newest
        if self.cfg.debug_checks:
            self.scheduler.check_invariants()
        self.stats["host_seconds"] += time.perf_counter() - t0
        return outputs

    def _dispatch(self, sched: SchedulerOutput) -> bool:
        """Device order: releases, swap-outs (before any reuse of their pages), inserts, the
        step, then swap-ins (a swapped-in sequence takes part from the next step on)."""
        cfg, core = self.cfg, self.core
        if sched.releases:
            self.state = core.release(self.state, batch_builder.release_mask(cfg, sched.releases))
        for seq, slot, pages in sched.swap_outs:
            self.state, saved = core.swap_out(self.state, np.int32(slot), self._pages(pages))
            seq.swapped = core.to_host(saved)
            self.stats["swap_outs"] += 1
        if sched.inserts:
            self.state = core.insert(self.state, batch_builder.build_insert(cfg, sched.inserts))
        dispatched = not sched.empty
        if dispatched:
            batch = batch_builder.build_step(cfg, sched)
            self.state, out = core.step(self.params, self.state, batch)
            self._inflight.append((sched, out))
        for seq, slot, pages in sched.swap_ins:
            saved = core.to_device(seq.swapped)
            self.state = core.swap_in(self.state, np.int32(slot), self._pages(pages), saved)
            seq.swapped = None
        if not dispatched:
            return False
        self.stats["steps"] += 1
        self.stats["decode_rows"] += len(sched.decodes)
        if self.scheduler.waiting:  # slot utilization while requests queue for a slot
            self.stats["steps_while_queued"] += 1
            self.stats["busy_slots_while_queued"] += len(self.scheduler.running)
        self.stats["prompt_tokens"] += sum(len(c.token_ids) for c in sched.chunks)
        return True

    def _pages(self, pages: list[int]) -> np.ndarray:
        padded = self.core.unused_pages()
        padded[: len(pages)] = pages
        return padded

    def _process(self, sched: SchedulerOutput, out: StepOutput) -> list[RequestOutput]:
        t0 = time.perf_counter()
        tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
        self.stats["device_wait_seconds"] += time.perf_counter() - t0
        now = time.monotonic()
        results = []
        for seq, slot in sched.samplers:
            seq.inflight -= 1
            if seq.finished:
                continue  # finished by an earlier step's token, or aborted
            if seq.first_token_time is None:
                seq.first_token_time = now
            self.stats["tokens"] += 1
            done = stop_checker.append_token(seq, int(tokens[slot]), float(logprobs[slot]))
            if done is not None:
                self.scheduler.finish(seq, *done)
            results.append(self._output(seq, delta_ids=[seq.output_ids[-1]]))
        return results

    def _output(self, seq: Request, delta_ids: list[int]) -> RequestOutput:
        finished = seq.finished
        delta_text = stop_checker.text_to_emit(seq, finished)
        completion = CompletionOutput(
            index=0,
            text=seq.text[: seq.emitted_text_len],
            token_ids=list(seq.output_ids),
            cumulative_logprob=float(sum(seq.logprobs)),
            logprobs=list(seq.logprobs),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        metrics = {"arrival_time": seq.arrival_time, "num_preemptions": seq.num_preemptions}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        return RequestOutput(
            seq.request_id,
            seq.prompt,
            list(seq.prompt_ids),
            [completion],
            finished,
            delta_ids,
            delta_text,
            metrics,
        )

    POLICY_FIELDS = ("enable_prefix_caching", "aging_steps", "preemption_mode")

    def set_policies(self, **policies) -> None:
        """Change scheduling policies (prefix caching, aging, preemption mode) while idle; the
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
        """Recover from a failed step (its donated device state may be gone): build a fresh
        state and scheduler. Requests that never reached the device are requeued (unless
        ``requeue_waiting`` is False); every other unfinished request is dropped. Returns the
        dropped request ids."""
        self.state = self.core.init_state()
        self._inflight.clear()
        old, self.scheduler = self.scheduler, Scheduler(self.cfg)
        pristine = [s for s in old.waiting if s.admitted_at < 0 and not s.inflight]
        if requeue_waiting:
            for seq in pristine:
                self.scheduler.add(seq)
        keep = {id(s) for s in pristine} if requeue_waiting else set()
        dropped = []
        for rid, seq in list(self.requests.items()):
            if not seq.finished and id(seq) not in keep:
                seq.status, seq.finish_reason = RequestStatus.FINISHED, "abort"
                del self.requests[rid]
                dropped.append(rid)
        return dropped

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record."""
        seq = self.requests.get(request_id)
        if seq is not None and seq.finished:
            del self.requests[request_id]

    def drain(self) -> None:
        """Wait for in-flight steps (used before inspecting device state in tests)."""
        while self._inflight:
            self._process(*self._inflight.popleft())

    def status_counts(self) -> dict[str, int]:
        return collections.Counter(s.status.value for s in self.requests.values())

    def forget_finished(self) -> None:
        """Drop finished requests' records (long-running servers call this periodically)."""
        for rid in [r for r, s in self.requests.items() if s.status is RequestStatus.FINISHED]:
            del self.requests[rid]
