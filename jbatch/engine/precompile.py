"""Get every step program of an engine compiled before warm-up runs it: loaded from the
executable store where it holds them, else lowered and compiled concurrently.

1. Stored programs (:mod:`jbatch.engine.executable_store`) are deserialized in threads: no
   tracing, no lowering, no compile.
2. The rest are traced and lowered one at a time (Python, under the GIL), then compiled in
   threads: XLA compiles with the GIL released, so the compiles of the 7-ish bucket programs
   overlap on a multi-core host (with JAX's persistent compilation cache,
   :mod:`jbatch.compile_cache`, the threads load executables from disk instead).
3. Each program XLA compiled here is written to the store (when on) for the next start. One
   that JAX's persistent cache supplied is not: XLA:CPU cannot serialize an executable that was
   itself deserialized (jax 0.10.2: the copy fails to run, "Function ... not found", or to
   serialize, "`LessThan` is not serializable"), so such a program is stored only once XLA
   compiles it again (while JAX's cache holds it, never).

The engine dispatches the returned ``Compiled`` objects themselves, so warm-up's steps and every
later step run exactly these executables (measured: the same dispatch cost as the ``jit``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

import jax

from jbatch.engine.executable_store import ExecutableStore

_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded in the thread that compiles
_seen = threading.local()


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        _seen.cache_hit = True


jax.monitoring.register_event_listener(_on_event)


def _map(fn, items: list, workers: int | None) -> list:
    workers = workers or min(len(items), os.cpu_count() or 1)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers, thread_name_prefix="jbatch-compile") as pool:
        return list(pool.map(fn, items))


def compile_all(lowered: list, workers: int | None = None) -> list[jax.stages.Compiled]:
    """``compile()`` every lowered program, ``workers`` at a time (default: one per CPU)."""
    return _map(lambda program: program.compile(), lowered, workers) if lowered else []


def _compile(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """The compiled program, and whether XLA compiled it (False: JAX's persistent cache
    supplied it)."""
    _seen.cache_hit = False
    compiled = lowered.compile()
    return compiled, not _seen.cache_hit


def prepare(
    programs: dict[Hashable, tuple[str, Callable[[], jax.stages.Lowered]]],
    store: ExecutableStore | None = None,
    devices: list | None = None,
    workers: int | None = None,
) -> tuple[dict[Hashable, jax.stages.Compiled], dict[str, int], list[str]]:
    """``programs``: name -> (store key, a function lowering it); ``devices``: the devices the
    programs run on, in order (needed with a ``store``). Returns name -> compiled program, and
    counts: ``loaded`` from the store, ``compiled`` here (lowered, then compiled or taken from
    JAX's persistent cache), ``stored`` into the store; and the store keys of those loaded."""
    names = list(programs)
    ready: dict[Hashable, jax.stages.Compiled] = {}
    if store is not None:
        loaded = _map(lambda name: store.load(programs[name][0], devices), names, workers)
        ready = {name: c for name, c in zip(names, loaded) if c is not None}
    missing = [name for name in names if name not in ready]
    lowered = [programs[name][1]() for name in missing]
    stored = 0
    for name, (program, fresh) in zip(missing, _map(_compile, lowered, workers)):
        ready[name] = program
        if store is not None and fresh:
            stored += store.save(programs[name][0], program)
    counts = {"loaded": len(names) - len(missing), "compiled": len(missing), "stored": stored}
    loaded_keys = [programs[name][0] for name in names if name not in missing]
    return ready, counts, loaded_keys
