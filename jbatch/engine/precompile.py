"""Compile the engine's step programs concurrently before warm-up runs them.

Tracing and lowering are Python (one at a time, under the GIL), but XLA compiles with the GIL
released, so the compiles of the 7-ish bucket programs overlap on a multi-core host. JAX keeps
each executable it compiles for a ``jit(f).trace(...).lower()``, so warm-up's first call of each
step with the same arguments finds it and compiles nothing (measured: 0.01-0.03 s per first
step after this, vs 6-30 s each without). With the persistent compilation cache
(:mod:`jbatch.compile_cache`) the threads load executables from disk instead.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor


def compile_all(lowered: list, workers: int | None = None) -> None:
    """``compile()`` every lowered program, ``workers`` at a time (default: one per CPU)."""
    if not lowered:
        return
    workers = workers or min(len(lowered), os.cpu_count() or 1)
    if workers <= 1:
        for program in lowered:
            program.compile()
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="jbatch-compile") as pool:
        list(pool.map(lambda program: program.compile(), lowered))
