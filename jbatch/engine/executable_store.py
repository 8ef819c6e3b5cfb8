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
  count), the host CPU's ISA flags, ``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``, ``--xla*`` arguments
  and every jax config value but cache and logging settings;
* the model config, the draft model's and the engine config (all fields: a field that does
  not reach the program only costs a miss), the mesh, the program's bucket key;
* the signature of its arguments: tree structure, shape, dtype, weak type, sharding and its
  devices (in order) of every leaf (params, state, step input buffers, token bitmask).

It lives in ``<compilation cache dir>/jbatch-executables`` and is on exactly when the
compilation cache is (one switch), unless that is a URL (``gs://``) or no sources are found.
A file that fails to load is deleted and counts as a miss; a store that cannot be read or
written (permissions, a full disk) only logs. Each new source version or config adds its
programs (a few MB each), so the store is bounded like JAX's own cache and by the same figure,
``jax_compilation_cache_max_size`` (:mod:`jbatch.compile_cache` sets it): after a save, the
least recently used files (a load touches its file) go until the directory fits; a program
larger than the whole budget is not stored, as JAX does; -1: no limit.
Like JAX's own cache, loading runs code from that directory: it must be trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import pickle
import platform
import sys
import tempfile
from pathlib import Path

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a file holds changes
SUBDIR = "jbatch-executables"
SUFFIX = ".jaxexe"  # one stored program
_PACKAGES = ("jbatch", "pallas_kernels")
# jax config values left out of the key: where caches live and what is logged (the rest, any
# flag that may change tracing, lowering or compiling, is in it).
_NOT_PROGRAM = ("jax_compilation_cache", "jax_persistent_cache", "jax_log", "jax_explain",
                "jax_debug_log", "jax_raise_persistent_cache")  # fmt: skip


def _source_fingerprint() -> str | None:
    """SHA-256 of every ``.py`` file of the packages whose code is traced into a program, and of
    the native kernels' ``.cc`` sources they call (None: no sources found, e.g. a bytecode-only
    install: the store stays off)."""
    h, found = hashlib.sha256(), 0
    for package in _PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.cc")]):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
            found += 1
    return h.hexdigest() if found else None


# Read once, when the engine is imported: the code that runs is the code that was imported,
# even if the files change later (an edit, a checkout) before a warm-up stores its programs.
_SOURCES = _source_fingerprint()


def source_fingerprint() -> str | None:
    return _SOURCES


def _host_cpu() -> str:
    """What the host CPU can run (on CPU the backend reports only "cpu"): its ISA flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return platform.machine() + ":" + hashlib.sha256(line.encode()).hexdigest()
    except OSError:
        pass
    return platform.machine() + ":" + platform.processor()


def environment() -> tuple:
    """Versions, backend and flags a compiled program depends on besides its own inputs."""
    import flax
    import jaxlib

    devices = jax.devices()
    backend = devices[0].client
    config = sorted(
        (name, repr(value))
        for name, value in jax.config.values.items()
        if not name.startswith(_NOT_PROGRAM)
    )
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
        _host_cpu(),
        os.environ.get("XLA_FLAGS", ""),
        os.environ.get("LIBTPU_INIT_ARGS", ""),
        tuple(a for a in sys.argv if a.startswith("--xla")),
        tuple(config),
    )


def signature(*trees) -> str:
    """The abstract signature of a call's arguments: structure, then each leaf's shape, dtype,
    weak type and sharding (a different placement is a different program)."""
    leaves, treedef = jax.tree.flatten(trees)
    parts = [str(treedef)]
    for x in leaves:
        weak = getattr(x, "weak_type", False)
        sharding = getattr(x, "sharding", None)
        parts.append(f"{x.dtype}{list(x.shape)}:{weak}:{sharding!r}:{device_ids(sharding)}")
    return "\n".join(parts)


def device_ids(placement) -> tuple[int, ...]:
    """The devices of a sharding or mesh, in its order (its ``repr`` does not name them: two
    replicas of one config on different devices must not share a program)."""
    if placement is None:
        return ()
    mesh = getattr(placement, "mesh", placement)
    if hasattr(mesh, "devices") and hasattr(mesh.devices, "flat"):
        return tuple(d.id for d in mesh.devices.flat)
    return tuple(sorted(d.id for d in placement.device_set))


def digest(*parts) -> str:
    """One key from ``repr`` of ``parts`` (configs, bucket keys, signatures), the sources and
    the environment."""
    text = repr((source_fingerprint(), environment(), parts))
    return hashlib.sha256(text.encode()).hexdigest()


class ExecutableStore:
    """Serialized compiled programs in one directory, one file per key."""

    def __init__(self, directory: str | Path, max_bytes: int | None = None):
        """``max_bytes``: the most the directory's programs may take (None: no limit)."""
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive (None: no limit), got {max_bytes}")
        self.directory, self.max_bytes = Path(directory), max_bytes

    @classmethod
    def from_compilation_cache(cls) -> ExecutableStore | None:
        """The store beside JAX's persistent compilation cache, with its size limit; None while
        that is off (a size of 0 turns JAX's off too) or is not a local directory (JAX also
        takes e.g. ``gs://`` URLs; the store does not)."""
        cache, limit = (
            jax.config.jax_compilation_cache_dir,
            jax.config.jax_compilation_cache_max_size,
        )
        if not cache or "://" in str(cache) or source_fingerprint() is None or limit == 0:
            return None
        return cls(Path(cache) / SUBDIR, None if limit < 0 else limit)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def load(self, key: str, devices: list) -> jax.stages.Compiled | None:
        """The program stored under ``key``, loaded onto ``devices`` (the ones it runs on, in
        its order; None: nothing stored)."""
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:  # unreadable here (permissions, not a file): compile instead
            log.warning("cannot read stored executable %s: %s", path, e)
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(blob)
            compiled = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=devices
            )
        except Exception as e:  # a torn or foreign file: drop it, compile afresh
            log.warning("dropping unreadable stored executable %s: %s", path, e)
            path.unlink(missing_ok=True)
            return None
        # Used now: the last to be evicted. Gone meanwhile (another engine evicted it) or a
        # read-only store: the program is loaded either way.
        with contextlib.suppress(OSError):
            os.utime(path)
        return compiled

    def drop(self, key: str) -> None:
        """Forget the program stored under ``key`` (it loaded but did not run)."""
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            log.warning("cannot drop stored executable %s: %s", self._path(key), e)

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Store ``compiled`` under ``key`` (atomically: a reader never sees half a file); only
        an executable XLA compiled in this process (``precompile.py``). A program that cannot
        be serialized is skipped with a log line (returns False)."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:
            log.warning("not storing an executable that cannot be serialized: %s", e)
            return False
        if self.max_bytes is not None and len(blob) > self.max_bytes:
            log.warning(
                "not storing a %d-byte executable: over the store's limit of %d bytes "
                "(jax_compilation_cache_max_size)", len(blob), self.max_bytes,
            )  # fmt: skip
            return False
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except OSError as e:  # a full disk, a read-only cache: the engine runs without it
            log.warning("cannot store an executable in %s: %s", self.directory, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False
        self.evict(keep=self._path(key))
        return True

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Delete the least recently used programs until the directory fits ``max_bytes``
        (never ``keep``, the one just stored); returns those deleted. Another engine may be
        evicting too: a file it already deleted counts as gone (its reader sees a miss)."""
        if self.max_bytes is None:
            return []
        files = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, path, st.st_size))
        total = sum(size for _, _, size in files)
        deleted = []
        for _, path, size in sorted(files, key=lambda f: f[:2]):  # oldest use first
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot evict stored executable %s: %s", path, e)
                continue
            total -= size
            deleted.append(path)
        return deleted
