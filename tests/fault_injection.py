"""Test-only fault hooks, installed on the engine thread (``EngineThread.call``).

* :func:`fail_step_at`: the ``n``-th device step from now is dispatched (state donated,
  requests admitted), then its host wrapper (``core.step``) raises.
* :func:`fail_detokenize_at`: the ``n``-th detokenization from now raises (inside the
  engine's output processing, after the device step).

Each hook fires once and removes itself; the engine's own recovery (``StepFailed``) must then
fail exactly the requests in flight and keep serving.
"""

from __future__ import annotations

from typing import Any


def fail_step_at(engine: Any, n: int = 1, message: str = "injected step fault") -> None:
    core, calls = engine.core, 0

    def step(*args):
        nonlocal calls
        calls += 1
        result = type(core).step(core, *args)
        if calls == n:
            del core.step  # the real method from now on
            raise RuntimeError(message)
        return result

    core.step = step


def fail_detokenize_at(engine: Any, n: int = 1, message: str = "injected detokenizer fault"):
    tokenizer, calls = engine.tokenizer, 0

    def decode(*args, **kw):
        nonlocal calls
        calls += 1
        if calls == n:
            del tokenizer.decode
            raise RuntimeError(message)
        return type(tokenizer).decode(tokenizer, *args, **kw)

    tokenizer.decode = decode
