"""Disaggregated prefill and decode in one process: a prefill engine and decode engines on
separate device groups behind one engine interface.

:class:`DisaggregatedEngine` implements :class:`jbatch.engine.interface.EngineClient`. New
requests go to the prefill engine (``role="prefill"``: prompt chunks only); once a request's
first token has been sampled and read, it is handed over (``jbatch/engine/handover.py``) to the
decode engine (``role="decode"``) with the most free pages: its KV pages and slot rows move with
one ``jax.device_put`` onto the decode engine's mesh (asynchronous: the copy runs on the
devices while the host goes on), and the decode engine swaps it into its own pool.

One host thread drives all engines, as :class:`ReplicaRouter` does: each ``step()`` dispatches
the prefill step, hands over what is ready, then dispatches each decode engine's step. Every
dispatch returns while the devices work, so neither engine waits for the other inside a step;
the prefill devices never run a decode row and the decode devices never run a prompt chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import jax

from jbatch.engine import handover
from jbatch.engine.interface import EngineStats, StepFailed
from jbatch.engine.llm_engine import LLMEngine
from jbatch.outputs import OutputKind, RequestOutput
from jbatch.sampling_params import SamplingParams

# Settings both sides must share: a slot's rows and page list have the same shapes.
_SHARED = ("page_size", "max_seq_len", "kv_cache_dtype", "dtype", "block_q")


class DisaggregatedEngine:
    """One prefill engine and one or more decode engines (see the module docstring)."""

    def __init__(self, prefill: LLMEngine, decodes: Seq[LLMEngine], warmup: bool = True):
        if prefill.cfg.role != "prefill":
            raise ValueError(f"the prefill engine has role={prefill.cfg.role!r}, not 'prefill'")
        if not decodes:
            raise ValueError("DisaggregatedEngine needs at least one decode engine")
        for engine in decodes:
            _check_pair(prefill, engine)
        self.prefill, self.decodes = prefill, list(decodes)
        self.model_cfg, self.cfg, self.tokenizer = prefill.model_cfg, prefill.cfg, prefill.tokenizer
        self.eos_ids = prefill.eos_ids
        self._owner: dict[str, LLMEngine] = {}  # request id -> engine holding it
        self._ids = itertools.count()
        self.handovers = 0  # requests handed over
        self.handed_to = [0] * len(self.decodes)
        if warmup:
            self._warm_transfer()

    def _warm_transfer(self) -> None:
        """One device copy onto each decode mesh (so the first handover is not a first time)."""
        p = self.prefill
        p.state, saved = p.core.swap_out(p.state, 0, p.core.unused_pages())
        for engine in self.decodes:
            jax.block_until_ready(engine.core.to_device(saved))

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
        tenant: str | None = None,
    ) -> str:
        if params is not None and isinstance(params, SamplingParams) and params.n > 1:
            raise ValueError(f"n={params.n}: disaggregated serving runs n == 1 requests only")
        request_id = f"r{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        rid = self.prefill.add_request(
            prompt, params, request_id, priority, arrival_time, output_kind, tenant
        )
        self._owner[rid] = self.prefill
        return rid

    def abort_request(self, request_id: str) -> None:
        engine = self._owner.get(request_id)
        if engine is not None:
            engine.abort_request(request_id)

    def forget(self, request_id: str) -> bool:
        engine = self._owner.get(request_id)
        if engine is None:
            return True
        if not engine.forget(request_id):
            return False
        del self._owner[request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        engines = [self.prefill, *self.decodes]
        return bool(self.prefill.handed_over) or any(e.has_unfinished_requests() for e in engines)

    # ---- the loop ------------------------------------------------------------------------------
    def free_pages(self, i: int) -> int:
        """Pages decode engine ``i`` can still give (``handover.free_pages``)."""
        return handover.free_pages(self.decodes[i].scheduler)

    def pick_decode(self) -> int:
        """The decode engine with the most free pages (ties: the first)."""
        return max(range(len(self.decodes)), key=self.free_pages)

    def _hand_over(self) -> None:
        for record, saved in handover.take_ready(self.prefill):
            i = self.pick_decode()
            handover.admit(self.decodes[i], record, saved)
            self._owner[record.request_id] = self.decodes[i]
            self.handovers += 1
            self.handed_to[i] += 1

    def step(self) -> list[RequestOutput]:
        """The prefill engine's step, the handovers it made ready, each decode engine's step.
        An engine that fails has recovered alone; the call then raises ``StepFailed`` with its
        failed requests and the other engines' outputs."""
        outputs: list[RequestOutput] = []
        failures: list[StepFailed] = []

        def run(engine: LLMEngine) -> None:
            nonlocal outputs
            if engine.has_unfinished_requests():
                try:
                    outputs += engine.step()
                except StepFailed as e:
                    failures.append(e)
                    outputs += e.outputs

        run(self.prefill)
        self._hand_over()
        for engine in self.decodes:
            run(engine)
        if failures:
            failed = [rid for e in failures for rid in e.failed]
            raise StepFailed(failed, outputs, failures[0].cause) from failures[0]
        return outputs

    def stats(self) -> EngineStats:
        """Every engine's snapshot, summed."""
        return EngineStats.total([e.stats() for e in (self.prefill, *self.decodes)])

    def reset(self, requeue_waiting: bool = True) -> list[str]:
        dropped = [rid for e in (self.prefill, *self.decodes) for rid in e.reset(requeue_waiting)]
        for rid in dropped:
            self._owner.pop(rid, None)
        return dropped

    def drain(self) -> list[RequestOutput]:
        """Run until every request has finished (tests and offline use); all outputs."""
        outputs = []
        while self.has_unfinished_requests():
            outputs += self.step()
        return outputs


def _check_pair(prefill: LLMEngine, decode: LLMEngine) -> None:
    if decode.cfg.role != "decode":
        raise ValueError(f"a decode engine has role={decode.cfg.role!r}, not 'decode'")
    for name in _SHARED:
        a, b = getattr(prefill.cfg, name), getattr(decode.cfg, name)
        if a != b:
            raise ValueError(f"prefill and decode engines differ in {name}: {a!r} vs {b!r}")
    heads = lambda e: getattr(e.model_cfg, "num_kv_heads", None)
    a, b = heads(prefill), heads(decode)
    if a != b:
        raise ValueError(
            f"prefill and decode engines hold {a} vs {b} KV heads (tp replicates KV heads "
            f"differently on the two sides); pick tp values that give both the same"
        )


def build_disaggregated(
    model_cfg, prefill_cfg, decode_cfg, *, devices=None, warmup: bool = True, **kwargs
) -> DisaggregatedEngine:
    """A :class:`DisaggregatedEngine`: the prefill engine over the first ``prefill_cfg.tp``
    devices, then ``decode_cfg.dp`` decode engines over ``decode_cfg.tp`` devices each
    (``devices``: default all). ``kwargs`` as for :func:`jbatch.parallel.build_engines`
    (``model_dir`` or ``params``, ``tokenizer``, ``eos_token_ids``)."""
    from jbatch.parallel.engines import build_engines

    devices = list(jax.devices() if devices is None else devices)
    if prefill_cfg.dp != 1:
        raise ValueError(f"the prefill side runs one engine (dp=1), got dp={prefill_cfg.dp}")
    need = prefill_cfg.tp + decode_cfg.tp * decode_cfg.dp
    if need > len(devices):
        raise ValueError(
            f"prefill tp={prefill_cfg.tp} plus decode tp={decode_cfg.tp} x dp={decode_cfg.dp} "
            f"needs {need} devices, {len(devices)} are available"
        )
    split = prefill_cfg.tp
    (prefill,) = build_engines(
        model_cfg, prefill_cfg, devices=devices[:split], warmup=warmup, **kwargs
    )
    decodes = build_engines(
        model_cfg, decode_cfg, devices=devices[split:need], warmup=warmup, **kwargs
    )
    return DisaggregatedEngine(prefill, decodes, warmup=warmup)
