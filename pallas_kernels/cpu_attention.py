"""Paged attention of small query blocks on the CPU: the C++ kernel ``cpu_attention.cc`` as an
XLA FFI custom call.

1. :func:`available` (first call per process) builds ``cpu_attention.cc`` with the system C++
   compiler (``$CXX``, else ``g++``/``c++``) into a per-machine cache, keyed by the source, the
   flags, jaxlib and the CPU (``-march=native``); a cached build only loads (milliseconds).
2. It loads the library with ``ctypes`` and registers its handler with XLA for the CPU platform
   as ``TARGET``.
3. :func:`cpu_paged_attention` calls it through ``jax.ffi.ffi_call`` inside any jitted program.

Why a native kernel on this path (docs/architecture.md, "Attention"): XLA:CPU gathers pages and
transposes chunks element by element, which made attention ~36% of a 30-layer decode step; the
kernel reads each key and value row in place through the page table, once per step.

No compiler, a failed build, or ``JBATCH_CPU_ATTENTION=0``: :func:`available` is False (the
reason is logged once, :func:`unavailable_reason`) and ``attn_impl="auto"`` keeps the XLA path;
``attn_impl="cpu"`` then fails naming the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Shaped

log = logging.getLogger(__name__)

TARGET = "jbatch_cpu_paged_attention"
SOURCE = Path(__file__).with_name("cpu_attention.cc")
# Query blocks up to this many rows always take the kernel (decode rows: 1, speculative groups:
# k + 1). Larger blocks (prompt blocks, ``block_q`` rows) take it when no row of the call sees more
# than MAX_PROMPT_KEYS keys, else XLA's batched dots (``dispatch.paged_attention`` picks at run
# time): the kernel walks keys row by row, which costs 0.14-0.6x the XLA chunk loop on short
# contexts and up to 1.3x on rows that see 700-2 500 keys (docs/benchmarks.md, "Step kinds vs
# vLLM; prompt blocks through the native attention kernel").
MAX_BLOCK_Q = 8
MAX_PROMPT_KEYS = 512
# A call shares its items with XLA's intra-op threads only from this much work (keys read x
# query heads x head dim, over all rows); below it the calling thread is done before a woken pool
# thread would help. Measured on the 2-core CI VM (`scripts/bench_cpu_attention.py --sharing`,
# docs/benchmarks.md): alone is 1.05-2.9x faster up to ~3e5 (the smallest calls most), sharing
# breaks even to 1.5x faster from ~4e5.
MIN_PARALLEL_WORK = 3 << 17
POOL_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn))
QUERY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
          "-fno-math-errno", "-Wall")  # fmt: skip
_ENV_SWITCH = "JBATCH_CPU_ATTENTION"


def _cpu_signature() -> str:
    """What ``-march=native`` compiles for: the CPU model and its ISA flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    root = os.environ.get("JBATCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jbatch"
    )
    return Path(root) / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build(cxx: str) -> Path:
    """The library for this machine, built unless the cache has it (atomic: a build writes a
    temporary file and renames it, so concurrent processes never load a partial one)."""
    include = jax.ffi.include_dir()
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(_FLAGS).encode(), cxx.encode(),
                 jax.lib.__version__.encode(), _cpu_signature().encode()):  # fmt: skip
        h.update(part)
        h.update(b"\0")
    out = _cache_dir() / f"cpu_attention-{h.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cxx, *_FLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _load() -> tuple[bool, str]:
    """(registered, reason it is not); runs once per process."""
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return False, f"{_ENV_SWITCH}=0"
    cxx = _compiler()
    if cxx is None:
        return False, "no C++ compiler found (set CXX, or install g++)"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        capsule = jax.ffi.pycapsule(lib.JbatchCpuPagedAttention)
        jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
    except Exception as e:  # any failure means: use the XLA path, say why
        log.warning("CPU attention kernel unavailable, using the XLA path: %s", e)
        return False, str(e)
    return True, ""


def available() -> bool:
    """Whether the kernel is built and registered (builds it on first call)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


def supports(q_dtype, pool_dtype) -> bool:
    return jnp.dtype(q_dtype) in QUERY_DTYPES and jnp.dtype(pool_dtype) in POOL_DTYPES


def cpu_paged_attention(
    q: Float[Array, "n bq h d"],
    k_pages: Shaped[Array, "p s kvh d"],
    v_pages: Shaped[Array, "p s kvh d"],
    block_tables: Int[Array, "n mp"],
    q_positions: Int[Array, "n bq"],
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
    k_scales: Float[Array, "p s kvh"] | None = None,
    v_scales: Float[Array, "p s kvh"] | None = None,
    min_parallel_work: int = MIN_PARALLEL_WORK,
) -> Float[Array, "n bq h d"]:
    """Same contract as :func:`~pallas_kernels.paged_attention_reference` (padding rows: zeros),
    computed by the native kernel. Needs :func:`available`. ``min_parallel_work``: the least work
    a call shares with XLA's threads (:data:`MIN_PARALLEL_WORK`; 0: always, results are the same
    either way)."""
    if not available():
        raise RuntimeError(f"the CPU attention kernel is unavailable: {unavailable_reason()}")
    if not supports(q.dtype, k_pages.dtype):
        raise ValueError(f"CPU attention takes q in {QUERY_DTYPES} and pools in {POOL_DTYPES}, "
                         f"got q {q.dtype}, pool {k_pages.dtype}")  # fmt: skip
    if (k_scales is None) != (jnp.dtype(k_pages.dtype).itemsize != 1):
        raise ValueError("8-bit pools need k_scales/v_scales, float pools take none")
    none = jnp.zeros((0,), jnp.bfloat16)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        none if k_scales is None else k_scales.astype(jnp.bfloat16),
        none if v_scales is None else v_scales.astype(jnp.bfloat16),
        block_tables.astype(jnp.int32),
        q_positions.astype(jnp.int32),
        scale=np.float32(q.shape[-1] ** -0.5 if scale is None else scale),
        soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
        sliding_window=np.int64(0 if sliding_window is None else sliding_window),
        min_parallel_work=np.int64(min_parallel_work),
    )
