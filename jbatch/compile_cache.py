"""JAX's persistent compilation cache for jbatch: where it lives, who turns it on.

A 30-layer model compiles one step program per bucket pair at warm-up; the cache stores each
compiled executable on disk, keyed by the program and the compiler, so a restarted engine loads
them instead of compiling (docs/benchmarks.md, "Engine warm-up"). The same switch turns on the
executable store in its ``jbatch-executables`` subdirectory
(:mod:`jbatch.engine.executable_store`), which also skips tracing and lowering the step programs.

* The commands ``jbatch generate``, ``serve`` and ``batch`` (:func:`for_cli`): on by default,
  in ``$XDG_CACHE_HOME/jbatch/xla`` (``~/.cache/jbatch/xla``); ``--compilation-cache DIR``
  moves it, ``--compilation-cache off`` disables it. The demo's ``jbatch generate`` starts in
  ~3 s instead of ~22 s once its programs are cached (2-core CPU, docs/benchmarks.md). A
  default directory that cannot be created (a read-only home) turns the cache off with a
  warning: a start without it is slower, not broken.
* ``LLM(...)`` (a library: it writes nowhere unasked): on only when ``JBATCH_COMPILATION_CACHE``
  names a directory. JAX's cache is process-wide: turned on by a library, it would also cache
  the caller's own jitted programs, which a command's process does not have.
* ``JBATCH_COMPILATION_CACHE`` (a directory, or ``off``) overrides the commands' default too;
  the test suite sets it to ``off`` so CI never writes into a home directory.
* Size: JAX's cache and the executable store each keep at most ``DEFAULT_MAX_BYTES`` (2 GiB),
  evicting the least recently used entries: each jbatch or jax upgrade, config or bucket change
  adds programs, and a server that runs for months must not fill its disk. JAX's own setting
  decides instead when it is given (``JAX_COMPILATION_CACHE_MAX_SIZE`` in bytes, ``-1``: no
  limit, or ``jax_compilation_cache_max_size`` set before ``enable``). A bounded JAX cache
  evicts by a ``<key>-atime`` file per entry, which an unbounded one never wrote; without it
  every later write fails (JAX warns and stores nothing), so ``enable`` dates such entries
  (their mtime) once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path

import jax

try:  # the file names of JAX's bounded cache (``jax._src.lru_cache``)
    from jax._src.lru_cache import _ATIME_SUFFIX, _CACHE_SUFFIX
except ImportError:  # another layout: nothing to date
    _ATIME_SUFFIX = _CACHE_SUFFIX = None

ENV = "JBATCH_COMPILATION_CACHE"
OFF = ("off", "none", "0", "")
DEFAULT_MAX_BYTES = 2 << 30  # each of JAX's cache and the executable store
_JAX_MAX_SIZE_ENV = "JAX_COMPILATION_CACHE_MAX_SIZE"  # JAX's own, read into its config
FLAG = "--compilation-cache"

log = logging.getLogger(__name__)


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jbatch" / "xla"


def enable(directory: str | Path | None) -> Path | None:
    """Turn the cache on in ``directory`` (``None`` / "off": leave it off); returns the path."""
    if directory is None or str(directory).strip().lower() in OFF:
        return None
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # skip tiny programs
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    unset = jax.config.jax_compilation_cache_max_size == -1 and _JAX_MAX_SIZE_ENV not in os.environ
    if unset:  # bounded unless JAX was told otherwise (module doc, "Size")
        jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
    if jax.config.jax_compilation_cache_max_size != -1:
        date_entries(path)
    return path


def date_entries(path: Path) -> int:
    """Give every entry of JAX's cache in ``path`` that has no access-time file one, from the
    entry's mtime (module doc, "Size"); returns how many were dated."""
    if _CACHE_SUFFIX is None:
        return 0
    dated = 0
    for entry in path.glob(f"*{_CACHE_SUFFIX}"):
        atime = entry.with_name(entry.name.removesuffix(_CACHE_SUFFIX) + _ATIME_SUFFIX)
        if atime.exists():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or a read-only cache
            atime.write_bytes(entry.stat().st_mtime_ns.to_bytes(8, "little"))
            dated += 1
    return dated


def from_env(default: str | Path | None = None) -> Path | None:
    """Enable as ``JBATCH_COMPILATION_CACHE`` says, else in ``default`` (None: stay off)."""
    return enable(os.environ.get(ENV, default))


def add_flag(parser: argparse.ArgumentParser) -> None:
    """The commands' ``--compilation-cache DIR|off`` (read by :func:`for_cli`)."""
    parser.add_argument(
        FLAG, default=None, metavar="DIR|off", help="persistent XLA compilation cache and "
        f"executable store (default: ${ENV}, else ~/.cache/jbatch/xla): a restart loads the "
        "compiled step programs instead of compiling them",
    )  # fmt: skip


def for_cli(flag: str | None) -> Path | None:
    """Enable the cache of a command (module doc): ``flag`` (its ``--compilation-cache``) if
    given, else ``JBATCH_COMPILATION_CACHE``, else :func:`default_dir`. A directory named by the
    flag or the variable that cannot be created is a ``ValueError`` naming it; the default one
    only turns the cache off, with a warning."""
    named = (FLAG, flag) if flag is not None else (ENV, os.environ.get(ENV))
    if named[1] is None:
        try:
            return enable(default_dir())
        except OSError as e:
            log.warning("compilation cache off: cannot create %s (%s)", default_dir(), e)
            return None
    try:
        return enable(named[1])
    except OSError as e:
        raise ValueError(f"{named[0]} {named[1]}: cannot use it as a cache directory: {e}") from e
