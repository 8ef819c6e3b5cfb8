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
   step in flight as the engine keeps (launch step k, then read step k-1's result), from the
   engine's current state (the inputs insert, release and write every slot and page the run
   used, so the device does the same work), and returns the wall time.

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

    def __enter__(self) -> DispatchRecorder:
        core = self.engine.core
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


def replay(engine, steps: list[tuple], state=None) -> tuple[float, list[np.ndarray]]:
    """``steps`` (a :class:`DispatchRecorder`'s) launched back to back on ``engine``'s
    programs, from ``state`` (default: the engine's; the engine keeps the state they leave):
    the wall seconds and each step's packed result."""
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
