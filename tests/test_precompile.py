"""Warm-up compiles the step programs concurrently first (jbatch/engine/precompile.py): the
steps warm-up then runs must find every executable compiled."""

from __future__ import annotations

from jbatch import LLM
from jbatch.demo import demo_model_path
from jbatch.engine.precompile import compile_all
from tests.compile_counter import count_compiles

SMALL = dict(max_slots=2, max_num_batched_tokens=16, num_pages=16, max_seq_len=64)


def test_steps_after_compile_all_compile_nothing():
    engine = LLM(str(demo_model_path()), warmup=False, **SMALL).engine
    core, params, state = engine.core, engine.params, engine.state
    keys = list(core.layouts)
    assert len(keys) >= 3
    compile_all([core.lower_step(params, state, *key) for key in keys], workers=2)
    with count_compiles() as compiled:
        for key in keys:
            inp = core.new_input(*key)
            inp.release[:] = True
            state, pending = core.step(params, state, inp)
            core.fetch(pending)
    assert compiled == [], f"warm-up steps compiled again: {compiled}"
