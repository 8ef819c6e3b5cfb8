"""Count XLA compilations (every one is logged by ``jax.log_compiles``)."""

from __future__ import annotations

import contextlib
import logging

import jax


@contextlib.contextmanager
def count_compiles():
    """``with count_compiles() as compiled: ...`` — ``compiled`` lists the compiled programs."""
    compiled: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Compiling "):
                compiled.append(msg.split(" with ")[0])

    handler = Handler(level=logging.DEBUG)
    logger = logging.getLogger("jax")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            yield compiled
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
