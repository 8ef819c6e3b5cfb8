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
    previous = vars(core).get("step")  # another test hook (slow steps) stays in the chain
    inner = core.step

    def step(*args):
        nonlocal calls
        calls += 1
        result = inner(*args)
        if calls == n:
            _restore(core, "step", previous)
            raise RuntimeError(message)
        return result

    core.step = step


def fail_detokenize_at(engine: Any, n: int = 1, message: str = "injected detokenizer fault"):
    tokenizer, calls = engine.tokenizer, 0
    previous = vars(tokenizer).get("decode")
    inner = tokenizer.decode

    def decode(*args, **kw):
        nonlocal calls
        calls += 1
        if calls == n:
            _restore(tokenizer, "decode", previous)
            raise RuntimeError(message)
        return inner(*args, **kw)

    tokenizer.decode = decode


def _restore(obj: Any, name: str, previous: Any) -> None:
    if previous is None:
        delattr(obj, name)  # the class's method again
    else:
        setattr(obj, name, previous)
