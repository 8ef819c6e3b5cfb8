"""EngineCore: the device functions of ``core.py`` jitted once per engine, state donated.

One engine step is **one dispatch**: ``core.engine_step`` (release, insert, step) compiled per
(prefill bucket, decode bucket) pair, fed by one packed :class:`StepInput` (``step_input.py``)
and a ``[slots, ceil(vocab / 32)]`` token bitmask (structured output; unconstrained steps pass
one all-ones mask that stays on the device),
returning the new state and one packed flat int32 result (tokens, sampled flags, logprob bits,
top logprobs: ``logprobs.pack``) whose device-to-host copy starts right after dispatch. Swaps
stay separate programs that run only on the steps that swap.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float32, Int32

from jbatch.engine import buckets, host_memory, step_programs, swap
from jbatch.engine.config import EngineConfig
from jbatch.engine.core import unpack_output
from jbatch.engine.executable_store import ExecutableStore, device_ids, digest, signature
from jbatch.engine.grammar import all_allowed
from jbatch.engine.logprobs import HostTopLogprobs, packed_width
from jbatch.engine.precompile import prepare
from jbatch.engine.spec_step import unpack_spec
from jbatch.engine.state import EngineState
from jbatch.engine.step_input import (
    SpareInputs,
    StepInput,
    StepInputLayout,
    all_layouts,
    spec_layouts,
)
from jbatch.models.config import ModelConfig
from pallas_kernels import resolve_impl

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step's results on the host (numpy, ``[slots]`` each)."""

    tokens: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray
    top: HostTopLogprobs | None = None  # per slot (``logprobs.py``; None: a stand-in core)
    prompt_top: HostTopLogprobs | None = None  # per prompt-chunk row
    # A speculative dispatch's (tokens [T, G, K+1], logprobs [T, G, K+1], counts [T, G],
    # proposals verified [T, G]) per step it planned (T; counts 0 past the steps it ran) and
    # group, in the order of its input's ``group_slots`` (``spec_block.py``); None for other
    # steps.
    spec: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    # A block of decode steps (``decode_block.py``): (tokens, sampled, logprobs), each
    # ``[steps, slots]``, step by step; the fields above are its first step's. None otherwise.
    block: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


@dataclasses.dataclass
class EngineCore:
    """The engine's compiled programs for one (model, engine config), and their dispatch.

    The programs are jitted by ``step_programs.py``, on one device or, with a ``mesh`` (a
    ``(1, tp)`` mesh of :mod:`jbatch.parallel`), with explicit shardings; ``model_cfg`` is then
    the sharded model's config (KV heads replicated when ``tp`` exceeds them).
    """

    model_cfg: ModelConfig
    cfg: EngineConfig
    mesh: Mesh | None = None
    draft_cfg: ModelConfig | None = None  # speculative decoding with a draft model

    def __post_init__(self):
        self.host = jax.devices("cpu")[0]
        # Builds and registers a native attention kernel now when one applies: programs loaded
        # from the executable store call it without being traced again.
        resolve_impl(self.cfg.attn_impl)
        self.layouts = all_layouts(self.cfg)
        self.spec_layouts = spec_layouts(self.cfg)  # speculative decoding (spec_step.py)
        self._multiprocess = jax.process_count() > 1
        # Step inputs in flight (dispatch index, input) and spare ones per bucket pair; a step
        # with a dispatch index below ``_fetched`` has finished.
        self._used_inputs: collections.deque[tuple[int, StepInput]] = collections.deque()
        self._spare_inputs = SpareInputs()
        self._dispatched = self._fetched = 0
        self.programs_run: collections.Counter = collections.Counter()  # steps per bucket pair
        # Step programs warm-up compiled or loaded (``precompile.prepare``), dispatched as they
        # are; a key missing here (no warm-up) goes through its ``jit``. ``warmup_programs``:
        # how many warm-up loaded from the executable store, compiled, and stored.
        self._ready: dict[tuple, jax.stages.Compiled] = {}
        self.warmup_programs = {"loaded": 0, "compiled": 0, "stored": 0}
        step_kwargs = dict(
            model_cfg=self.model_cfg, block_q=self.cfg.block_q, attn_impl=self.cfg.attn_impl
        )
        if self.draft_cfg is not None:  # every step program also runs the draft
            step_kwargs["draft_cfg"] = self.draft_cfg
        if self.mesh is not None:
            pages = self.unused_pages()
            args = (self.model_cfg, self.cfg, self.layouts, step_kwargs, pages)
            programs = step_programs.sharded(self.mesh, *args)
        else:
            args = (self.layouts, self.spec_layouts, step_kwargs)
            programs = step_programs.single_device(self.model_cfg, self.cfg, self.draft_cfg, *args)
        self._steps, self.split = programs.steps, programs.split
        self._swap_out, self._swap_in = programs.swap_out, programs.swap_in
        self._init = programs.init
        self.device, self.swapped_sharding = programs.device, programs.swapped_sharding
        allow_all = all_allowed(self.cfg.max_slots, self.model_cfg.vocab_size)
        self._allow_all = jax.device_put(allow_all, self.device)
        first = self.device if self.mesh is None else self.mesh.devices.flat[0]
        self._on_cpu = first.platform == "cpu"
        if self._on_cpu:  # every step's temporaries reuse freed pages (host_memory.py)
            host_memory.keep_freed_pages()

    # ---- the engine's calls ----------------------------------------------------------------------
    def new_input(self, rows: int, decode_rows: int) -> StepInput:
        """Empty host inputs for a step of ``rows`` prompt rows and ``decode_rows`` decode rows:
        a recycled input of that bucket whose step has finished (its buffers reset), else a
        fresh one. Steps run in dispatch order, so every step dispatched before the last one
        fetched is done reading its input."""
        return self._input(self.layouts[(rows, decode_rows)])

    def new_spec_input(self, groups: int) -> StepInput:
        """Empty host inputs for a speculative step of ``groups`` groups (as :meth:`new_input`)."""
        return self._input(self.spec_layouts[("spec", groups)])

    def _input(self, layout: StepInputLayout) -> StepInput:
        while self._used_inputs and self._used_inputs[0][0] < self._fetched:
            self._spare_inputs.put(self._used_inputs.popleft()[1])
        return self._spare_inputs.take(layout)

    def step(
        self,
        params: dict,
        state: EngineState,
        inp: StepInput,
        bitmask: Int32[np.ndarray, "slots words"] | None = None,
    ) -> tuple[EngineState, _Pending]:
        """Dispatch one step (returns at once); the result's host copy is already under way.
        ``inp``: from :meth:`new_input`, or :meth:`new_spec_input` for a speculative step
        (:meth:`fetch` then returns its per-group results in ``StepResult.spec``). ``bitmask``:
        tokens each slot may sample (``grammar.GrammarCompiler.bitmask``; a fresh array per
        step), None: all."""
        key = _key_of(inp)
        state, packed = self.launch(key, params, state, inp.ints, inp.floats, bitmask)
        self.programs_run[key] += 1
        block = int(inp.batch.decode_steps[0]) if buckets.runs_blocks(self.cfg, *key) else 0
        return state, self._dispatched_step(inp, packed, block)

    def launch(
        self,
        key: tuple,
        params: dict,
        state: EngineState,
        ints: Int32[np.ndarray, " n"],
        floats: Float32[np.ndarray, " m"],
        bitmask: Int32[np.ndarray, "slots words"] | None = None,
    ) -> tuple[EngineState, Int32[Array, " r"]]:
        """Launch the step program of bucket ``key`` on packed inputs (a ``StepInput``'s
        ``ints`` / ``floats``) and return the new state and the packed result, with none of
        :meth:`step`'s bookkeeping (``scripts/dispatch_replay.py`` replays recorded steps so)."""
        program = self._ready.get(key)
        program = self._steps[key] if program is None else program
        return program(params, state, ints, floats, self._mask(bitmask))

    def forward(self, params: dict, state: EngineState, inp: StepInput):
        """Dispatch the forward half of a step (``split_step.py``; ``structured_overlap``)."""
        key = _key_of(inp)
        state, fwd = self.split.forward(key, params, state, inp)
        self.programs_run[key] += 1
        return state, (fwd, inp)

    def sample(self, state: EngineState, forwarded, bitmask=None) -> tuple[EngineState, _Pending]:
        """Dispatch the sampling half of a step whose :meth:`forward` was dispatched."""
        fwd, inp = forwarded
        state, packed = self.split.sample(state, fwd, self._mask(bitmask))
        return state, self._dispatched_step(inp, packed)

    def _mask(self, bitmask):
        # Committed to the state's placement like the all-ones mask (one cache key: no compile).
        return self._allow_all if bitmask is None else jax.device_put(bitmask, self.device)

    def _dispatched_step(self, inp: StepInput, packed, block: int = 0) -> _Pending:
        self._used_inputs.append((self._dispatched, inp))
        self._dispatched += 1
        # The host reads one copy of the replicated result (with several processes: its own).
        local = packed.addressable_shards[0].data if self._multiprocess else packed
        if not self._on_cpu:  # on a CPU the result is host memory already: nothing to copy
            local.copy_to_host_async()
        spec = None
        if _key_of(inp)[0] == "spec":
            spec = inp.batch.group_slots.shape[0], self.cfg.num_speculative_tokens + 1
            block = int(inp.batch.steps[0])
        return _Pending(self._dispatched - 1, packed, local, spec, block)

    def fetch(self, pending: _Pending) -> StepResult:
        """Wait for a dispatched step's results."""
        packed, spec, block = np.asarray(pending.local), None, None
        if pending.spec is not None:  # one row per step it may run; the first is the head
            rows = packed.reshape(self.cfg.decode_steps, -1)[: pending.block]
            steps = [unpack_spec(row, *pending.spec) for row in rows]
            spec = tuple(np.stack(field) for field in zip(*(head for head, _ in steps)))
            packed = steps[0][1]
        elif pending.block:  # the first step's row (the result's head), then decode rows
            packed, block = self._block_rows(packed, pending.block)
        result = StepResult(*unpack_output(packed, self.cfg.max_slots), spec=spec, block=block)
        # Its input may be recycled only once *every* device has finished the step: one
        # device's copy of the result can be ready while another still reads the input.
        jax.block_until_ready(pending.packed)
        self._fetched = max(self._fetched, pending.index + 1)  # this step and all before: done
        return result

    def _block_rows(self, packed: np.ndarray, ran: int):
        """A block program's flat result (``decode_block.engine_block``): the first step's
        packed row, and the block's (tokens, sampled, logprobs), each ``[ran, slots]`` (None for
        a block of one step: an ordinary step's result)."""
        s = self.cfg.max_slots
        width = packed_width(s)  # a decode row's
        first = packed[: packed.shape[0] - (self.cfg.decode_steps - 1) * width]
        if ran == 1:
            return first, None
        rows = packed[first.shape[0] :].reshape(-1, width)[: ran - 1, : 3 * s]
        heads = np.concatenate([first[None, : 3 * s], rows]).reshape(ran, 3, s)
        return first, (heads[:, 0], heads[:, 1].astype(bool), heads[:, 2].view(np.float32))

    def lower_step(
        self, params: dict, state: EngineState, rows: int, decode_rows: int, platforms=None
    ):
        """The step program of one bucket pair, lowered (for inspecting the compiled HLO);
        ``platforms`` (e.g. ``("tpu",)``) cross-lowers for other backends."""
        return self._lower(params, state, self.new_input(rows, decode_rows), platforms)

    def _lower(self, params: dict, state: EngineState, inp: StepInput, platforms=None):
        traced = self._steps[_key_of(inp)].trace(
            params, state, inp.ints, inp.floats, self._allow_all
        )
        return traced.lower(lowering_platforms=platforms)

    def swap_out(self, state: EngineState, slot: int, pages: np.ndarray, n: int | None = None):
        """Copy ``slot`` out; ``n``: only the first ``n`` entries of ``pages`` (a handover's
        page bucket), else all ``max_pages_per_seq``."""
        return self._swap_out(state, np.int32(slot), pages if n is None else pages[:n])

    def swap_in(
        self, state: EngineState, slot: int, pages: np.ndarray, saved, shared: int = 0
    ) -> EngineState:
        """Write ``saved`` into ``pages`` (padded to ``max_pages_per_seq``; cut to the pages
        ``saved`` holds) of ``slot``; the first ``shared`` pages are prefix-cache hits the slot
        shares, not written."""
        n = jax.tree.leaves(saved.kv)[0].shape[0]
        write = pages[:n].copy()
        write[:shared] = self.cfg.num_pages
        return self._swap_in(state, np.int32(slot), pages[:n], saved, write)

    def unused_pages(self) -> np.ndarray:
        """A page list of only padding (``num_pages``), the shape swap functions take."""
        return np.full(self.cfg.max_pages_per_seq, self.cfg.num_pages, np.int32)

    def init_state(self) -> EngineState:
        """A fresh state. Inputs of steps still in flight are never recycled after this: a new
        state does not depend on them, so their steps may finish after later ones."""
        self._used_inputs.clear()
        return self._init()

    def to_host(self, saved: swap.SwappedSlot) -> swap.SwappedSlot:
        if self.mesh is not None:  # each local shard to host RAM (no gather, no compile)
            return jax.tree.map(_HostShards.of, saved)
        return saved if self.host == self.device else jax.device_put(saved, self.host)

    def to_device(self, saved: swap.SwappedSlot) -> swap.SwappedSlot:
        """A swapped slot from host RAM (``to_host``) or from another engine's devices (a
        handover) onto this engine's placement."""
        if self.mesh is not None:
            put = lambda h, s: jax.device_put(h, s) if isinstance(h, jax.Array) else h.to_device(s)
            return jax.tree.map(put, saved, self.swapped_sharding)
        return jax.device_put(saved, self.device)

    def _store_key(self, params: dict, state: EngineState, inp: StepInput) -> str:
        """What a step program is made of (``executable_store.py``): configs, bucket, mesh and
        the signature of its arguments."""
        args = signature(params, state, inp.ints, inp.floats, self._allow_all)
        configs = (self.model_cfg, self.draft_cfg, self.cfg, self.mesh)
        return digest(*map(repr, configs), device_ids(self.mesh), _key_of(inp), args)

    def warmup(self, params: dict, state: EngineState) -> EngineState:
        """Compile every program the engine will ever run (one step per bucket pair) and run
        each once; step programs come from the executable store when it holds them. A stored
        program that loads but fails to run (a key that missed what made it) is dropped from
        the store and compiled afresh."""
        store = None if self._multiprocess else ExecutableStore.from_compilation_cache()
        loaded = self._prepare_steps(params, state, store)
        try:
            return self._run_once(params, state)
        except Exception:
            if not loaded:
                raise
            log.warning("a stored step program failed at warm-up; compiling it", exc_info=True)
            for key in loaded:
                store.drop(key)
            state = self.init_state()  # the failed step may have consumed the donated state
            self._prepare_steps(params, state, store)
            return self._run_once(params, state)

    def _prepare_steps(self, params: dict, state: EngineState, store) -> list[str]:
        """Every step program loaded or compiled (``precompile.prepare``); the store keys of
        those loaded."""
        inputs = [self.new_input(*key) for key in self.layouts]
        inputs += [self.new_spec_input(g) for _, g in self.spec_layouts]
        programs = {
            _key_of(inp): (
                self._store_key(params, state, inp),
                functools.partial(self._lower, params, state, inp),
            )
            for inp in inputs
        }
        devices = [self.device] if self.mesh is None else list(self.mesh.devices.flat)
        self._ready, self.warmup_programs, loaded = prepare(programs, store, devices)
        if self._on_cpu:  # room at the heap's top for the largest program's temporaries
            host_memory.keep_freed_pages(host_memory.FLOOR + _largest_temp(self._ready.values()))
        return loaded

    def _run_once(self, params: dict, state: EngineState) -> EngineState:
        """Run every program once on an empty batch (swaps, handovers, each step bucket)."""
        if self.cfg.swaps:
            state, saved = self.swap_out(state, 0, self.unused_pages())
            saved = self.to_device(self.to_host(saved))  # the round trip a swap makes
            state = self.swap_in(state, 0, self.unused_pages(), saved)
        if self.cfg.role != "mixed":  # handovers: out on a prefill engine, in on a decode one
            for n in buckets.handover_page_buckets(self.cfg):
                state, saved = self.swap_out(state, 0, self.unused_pages(), n)
                if self.cfg.role == "decode":
                    state = self.swap_in(state, 0, self.unused_pages(), saved)
        for rows, decode_rows in self.layouts:
            inp = self.new_input(rows, decode_rows)
            inp.release[:] = True  # retire every slot: warm-up leaves none active
            state, pending = self.step(params, state, inp)
            self.fetch(pending)
            if self.cfg.structured_overlap:  # the same step as two programs
                inp = self.new_input(rows, decode_rows)
                inp.release[:] = True
                state, pending = self.sample(*self.forward(params, state, inp))
                self.fetch(pending)
        for _, groups in self.spec_layouts:
            inp = self.new_spec_input(groups)
            inp.release[:] = True
            state, pending = self.step(params, state, inp)
            self.fetch(pending)
        self.programs_run.clear()
        return state


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A dispatched step: its dispatch index, its packed result on every device, and the copy
    the host reads (its transfer to the host under way)."""

    index: int
    packed: Int32[Array, " n"]
    local: Int32[Array, " n"]
    spec: tuple[int, int] | None = None  # a speculative dispatch's (groups, K + 1)
    # A block of decode steps (``decode_block.py``) or a speculative dispatch: the steps it
    # runs at most.
    block: int = 0


def _largest_temp(programs) -> int:
    """The largest temporary buffer (bytes) of compiled ``programs`` (0 where XLA does not say)."""
    sizes = [getattr(p.memory_analysis(), "temp_size_in_bytes", 0) for p in programs]
    return max(sizes, default=0)


def _key_of(inp: StepInput) -> tuple:
    """The program a step input feeds: its (prefill rows, decode rows) bucket pair, or
    ``("spec", groups)``."""
    return inp.layout.key


@dataclasses.dataclass
class _HostShards:
    """A sharded array's process-local shards in host RAM (one swapped-out KV buffer or row)."""

    shape: tuple[int, ...]
    shards: list[tuple[jax.Device, np.ndarray]]

    @classmethod
    def of(cls, a: jax.Array) -> _HostShards:
        return cls(a.shape, [(s.device, np.asarray(s.data)) for s in a.addressable_shards])

    def to_device(self, sharding: NamedSharding) -> jax.Array:
        bufs = [jax.device_put(x, d) for d, x in self.shards]
        return jax.make_array_from_single_device_arrays(self.shape, sharding, bufs)
