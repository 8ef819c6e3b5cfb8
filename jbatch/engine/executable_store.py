"""Compiled step programs on disk, loaded at warm-up without tracing or lowering them again.

JAX's persistent compilation cache (:mod:`jbatch.compile_cache`) skips XLA's compile, but its
key is the lowered program, so a warm start still traces and lowers every step program: 5.7 s
of a 30-layer model's 14.7 s warm start, all of it Python under the GIL (docs/benchmarks.md,
"Engine warm-up"). This store keys each *compiled* program by what it is made from instead and
keeps it serialized (``jax.experimental.serialize_executable``), so a warm engine deserializes
its executables (in threads) and runs.

A program's key is a SHA-256 over everything that can change what tracing would produce:

* the source of ``jbatch`` and ``pallas_kernels`` (every ``.py`` file: any edit is a miss);
* jax, jaxlib, flax and Python versions, the backend (platform, version, device kinds and
  count), ``XLA_FLAGS`` and the jax config flags that change lowering;
* the model config, the draft model's and the engine config (all fields: a field that does
  not reach the program only costs a miss), the mesh, the program's bucket key;
* the signature of its arguments: tree structure, shape, dtype, weak type and sharding of
  every leaf (params, state, step input buffers, token bitmask).

It lives in ``<compilation cache dir>/jbatch-executables`` and is on exactly when the
compilation cache is (one switch). A file that fails to load is deleted and counts as a miss.
Like JAX's own cache, loading runs code from that directory: it must be trusted.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a file holds changes
SUBDIR = "jbatch-executables"
_PACKAGES = ("jbatch", "pallas_kernels")
# jax config flags that change how a program is traced or lowered.
_FLAGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_numpy_rank_promotion",
    "jax_use_shardy_partitioner",
)


@functools.cache
def source_fingerprint() -> str:
    """SHA-256 of every ``.py`` file of the packages whose code is traced into a program."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def environment() -> tuple:
    """Versions, backend and flags a compiled program depends on besides its own inputs."""
    import flax
    import jaxlib

    devices = jax.devices()
    backend = devices[0].client
    flags = tuple((name, str(getattr(jax.config, name, None))) for name in _FLAGS)
    return (
        FORMAT,
        jax.__version__,
        jaxlib.__version__,
        flax.__version__,
        sys.version,
        backend.platform,
        backend.platform_version,
        tuple(sorted({d.device_kind for d in devices})),
        len(devices),
        os.environ.get("XLA_FLAGS", ""),
        flags,
    )


def signature(*trees) -> str:
    """The abstract signature of a call's arguments: structure, then each leaf's shape, dtype,
    weak type and sharding (a different placement is a different program)."""
    leaves, treedef = jax.tree.flatten(trees)
    parts = [str(treedef)]
    for x in leaves:
        weak = getattr(x, "weak_type", False)
        parts.append(f"{x.dtype}{list(x.shape)}:{weak}:{getattr(x, 'sharding', None)!r}")
    return "\n".join(parts)


def digest(*parts) -> str:
    """One key from ``repr`` of ``parts`` (configs, bucket keys, signatures), the sources and
    the environment."""
    text = repr((source_fingerprint(), environment(), parts))
    return hashlib.sha256(text.encode()).hexdigest()


class ExecutableStore:
    """Serialized compiled programs in one directory, one file per key."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    @classmethod
    def from_compilation_cache(cls) -> ExecutableStore | None:
        """The store beside JAX's persistent compilation cache; None while that is off or
        is not a local directory (JAX also takes e.g. ``gs://`` URLs; the store does not)."""
        cache = jax.config.jax_compilation_cache_dir
        if not cache or "://" in str(cache):
            return None
        return cls(Path(cache) / SUBDIR)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.jaxexe"

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The program stored under ``key``, loaded onto this process's devices (None: none)."""
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(blob)
            return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
        except Exception as e:  # a torn or foreign file: drop it, compile afresh
            log.warning("dropping unreadable stored executable %s: %s", path, e)
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Store ``compiled`` under ``key`` (atomically: a reader never sees half a file); only
        an executable XLA compiled in this process (``precompile.py``). A program that cannot
        be serialized is skipped with a log line (returns False)."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:
            log.warning("not storing an executable that cannot be serialized: %s", e)
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True
