"""A step as two programs, forward then sampling (``EngineConfig.structured_overlap``).

A step in which structured-output requests sample needs their token bitmask, which needs the
previous step's tokens. With one program per step the engine must wait for those tokens, fill
the mask and only then dispatch (the device idles meanwhile). Split in two, the step's forward
(``core.engine_forward``: release, insert, the model, the logits) is dispatched first; while the
device runs it, the host reads the previous step's tokens, feeds the grammar matchers and fills
the mask; then the sampling program (``core.step_sample``) takes the logits and the mask. Same
math as the fused step (``core.step`` is the two composed), so the same tokens.

Compiled per bucket pair (forward and sampling: the sampling program's shapes are the pair's
sampling rows and its prompt rows, whose logprobs its result carries), on one device; warm-up
compiles them with the fused programs.
"""

from __future__ import annotations

import jax

from jbatch.engine.core import ForwardResult, engine_forward, step_sample
from jbatch.engine.state import EngineState
from jbatch.engine.step_input import StepInput, StepInputLayout


class SplitPrograms:
    """The forward and sampling programs of an :class:`EngineCore` (one device)."""

    def __init__(self, layouts: dict[tuple[int, int], StepInputLayout], step_kwargs: dict):
        def forward(layout: StepInputLayout):
            kwargs = {**step_kwargs, **layout.step_kwargs()}

            def run(params, state, ints, floats):
                return engine_forward(params, state, *layout.unpack(ints, floats), **kwargs)

            return jax.jit(run, donate_argnums=1)

        def sample(state: EngineState, fwd: ForwardResult, bitmask):
            state, out = step_sample(state, fwd, bitmask)
            return state, out.packed()

        self._forwards = {key: forward(layout) for key, layout in layouts.items()}
        self._sample = jax.jit(sample, donate_argnums=0)

    def forward(self, key, params: dict, state: EngineState, inp: StepInput):
        return self._forwards[key](params, state, inp.ints, inp.floats)

    def sample(self, state: EngineState, fwd: ForwardResult, mask):
        return self._sample(state, fwd, mask)
