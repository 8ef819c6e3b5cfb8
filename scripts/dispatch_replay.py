"""What an engine's host work costs a run: the run's step programs replayed back to back.

With async scheduling the engine plans and reads one step while the device runs another, so
``EngineStats.host_only_seconds`` (``step()``'s wall time less its waits for results) counts
host work that overlaps device work. What that work costs the run is the difference between
the run's wall time and the wall time of the same device work with no host work between the
launches:

1. :class:`DispatchRecorder` wraps an engine's ``core.step`` for one run and keeps each
   dispatched step's program key and a copy of its packed inputs (``StepInput.ints`` /
   ``floats``) and bitmask.
2. :func:`replay` launches the same programs on the same inputs in the same order, with one
   step in flight as the engine keeps (launch step k, then read step k-1's result), from a
   given state or the engine's current one (the inputs insert, release and write every slot
   and page the run used, so the device does the same work), and returns the wall time.

Only step programs are recorded: a run that also swapped or split a step (structured output's
``structured_overlap``) launched programs a replay would miss, and :func:`replay` refuses it.

The replay still pays each launch and each result read (the engine cannot avoid those), so
``1 - replay / run`` is the share of the run lost to the engine's own planning, input
building and output work — the share a faster host would win back.
"""

from __future__ import annotations

import time

import numpy as np


class DispatchRecorder:
    """Records the step dispatches of ``engine`` (an ``LLMEngine``) while entered: ``steps``
    (program key, packed int and float inputs, bitmask) and ``results`` (each step's packed
    result as the device returned it)."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[tuple] = []
        self.results: list = []
        self.dispatches = 0  # every dispatch of the engine while entered, recorded or not

    def __enter__(self) -> DispatchRecorder:
        core = self.engine.core
        self.dispatches = -self.engine.counters["dispatches"]
        launch = core.step

        def recorded(params, state, inp, bitmask=None):
            self.steps.append((inp.layout.key, inp.ints.copy(), inp.floats.copy(), bitmask))
            state, pending = launch(params, state, inp, bitmask)
            self.results.append(pending.packed)
            return state, pending

        core.step = recorded
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.core.step  # the class's method again
        self.dispatches += self.engine.counters["dispatches"]


def replay(engine, recorded: DispatchRecorder, state=None) -> tuple[float, list[np.ndarray]]:
    """The steps ``recorded`` launched back to back on ``engine``'s programs, from ``state``
    (default: the engine's; the engine keeps the state they leave): the wall seconds and each
    step's packed result."""
    steps = recorded.steps
    if recorded.dispatches != len(steps):
        raise ValueError(
            f"the run dispatched {recorded.dispatches} programs, {len(steps)} of them step "
            f"programs: a replay of the steps alone is not the run's device work (swaps?)"
        )
    core, last, results = engine.core, None, []
    state = engine.state if state is None else state
    t0 = time.perf_counter()
    for key, ints, floats, bitmask in steps:
        state, packed = core.launch(key, engine.params, state, ints, floats, bitmask)
        if last is not None:
            results.append(np.asarray(last))
        last = packed
    if last is not None:
        results.append(np.asarray(last))
    wall = time.perf_counter() - t0
    engine.state = state
    return wall, results
