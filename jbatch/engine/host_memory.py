"""Keep freed host memory mapped for reuse when the engine computes on the CPU.

XLA:CPU allocates each run's temporary buffer with ``malloc`` and frees it when the run ends
(a 30-layer step of SmolLM2-135M's shape at 32 rows: a 40 MB buffer, the LM head's logits and
the sampler's work arrays). glibc serves an allocation above its mmap threshold (at most 32 MiB)
with a fresh ``mmap`` and unmaps it on free, and gives the top of its heap back to the kernel
once more than the trim threshold is free there, so every step faulted the pages it touched in
afresh: ~1 740 minor page faults and ~4 ms of kernel CPU time a step (``docs/benchmarks.md``,
"Host memory"). vLLM's CPU backend asks its users to preload tcmalloc for the same reason.

:func:`keep_freed_pages` sets two glibc options instead (process-wide, only ever raised):
``M_MMAP_MAX`` 0, so every allocation comes from the heap and is reused after it is freed,
and ``M_TRIM_THRESHOLD`` of at least ``nbytes``, so that much free memory stays mapped at the
heap's top. An engine on a CPU device calls it with 64 MiB (:data:`FLOOR`) plus its largest
program's temporary size; other backends keep their temporaries on the accelerator and do not
call it. A process that is not on glibc is left as it is. ``JBATCH_KEEP_HOST_PAGES=0`` opts out.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
FLOOR = 64 << 20  # trim threshold at least this (glibc's own default is 128 KiB)
OPT_OUT = "JBATCH_KEEP_HOST_PAGES"

_kept = 0  # the trim threshold set so far (0: not set by this module)
_lock = threading.Lock()  # engines may be built in threads (dp replicas): raise it in order


def _mallopt():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return getattr(ctypes.CDLL(None), "mallopt", None)


def keep_freed_pages(nbytes: int = 0) -> int:
    """Keep at least ``max(nbytes, FLOOR)`` bytes of freed heap memory mapped, and serve large
    allocations from the heap. Returns the trim threshold now in force from this module (0:
    not applied: not glibc, or opted out with ``JBATCH_KEEP_HOST_PAGES=0``)."""
    global _kept
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    switch = os.environ.get(OPT_OUT, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{OPT_OUT} must be 0 or 1, got {switch!r}")
    if switch == "0":
        return 0
    want = min(max(int(nbytes), FLOOR), _INT_MAX)  # mallopt takes an int
    with _lock:
        if want <= _kept:
            return _kept
        mallopt = _mallopt()
        if mallopt is None:
            return 0
        if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, want)):
            log.warning("glibc mallopt refused the host-memory options; freed pages are not kept")
            return 0
        _kept = want
    log.info("host memory: large allocations from the heap, %d MiB of it kept free", want >> 20)
    return want


def kept() -> int:
    """The trim threshold this module set (0: none)."""
    return _kept
