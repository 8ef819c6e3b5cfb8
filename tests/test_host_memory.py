"""Host memory on a CPU backend (``jbatch/engine/host_memory.py``): freed large blocks stay in the
heap for the next step's temporaries instead of being unmapped and faulted in again.

The glibc options are process-wide, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Loads host_memory.py alone (no jax), calls keep_freed_pages with each size given ("off":
# none), mallocs and frees a 40 MiB block (above glibc's largest mmap threshold, 32 MiB) twice,
# and reports how the second allocation was served: bytes in mmapped blocks while it lived,
# free bytes the heap kept after it was freed, and the minor page faults of writing it.
PROBE = textwrap.dedent(
    """
    import ctypes, importlib.util, json, resource, sys
    spec = importlib.util.spec_from_file_location("host_memory", sys.argv[1])
    host_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_memory)

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 40 << 20

    def cycle():
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        mapped = libc.mallinfo2().hblkhd
        libc.free(p)
        return mapped, libc.mallinfo2().fordblks

    kept = 0
    for n in sys.argv[2].split(",") if sys.argv[2] != "off" else ():  # calls in that order
        kept = host_memory.keep_freed_pages(int(n))
    first = cycle()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = cycle()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(json.dumps(dict(kept=kept, mapped=second[0], free=second[1], faults=faults)))
    """
)


def _run_probe(nbytes: str, **env) -> subprocess.CompletedProcess:
    path = str(ROOT / "jbatch" / "engine" / "host_memory.py")
    return subprocess.run(
        [sys.executable, "-c", PROBE, path, nbytes],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


def _probe(nbytes: str, **env) -> dict:
    out = _run_probe(nbytes, **env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_freed_block_is_reused_from_the_heap_without_page_faults():
    before = _probe("off")  # glibc's defaults: mapped on its own, unmapped on free
    assert before["mapped"] >= 40 << 20
    after = _probe("0")
    assert after["kept"] == 64 << 20  # host_memory.FLOOR
    assert after["mapped"] < 1 << 20  # served from the heap ...
    assert after["free"] >= 40 << 20  # ... and kept there once freed
    assert after["faults"] < 1000  # rewriting it touches pages already mapped (10 240 fresh)


def test_the_threshold_follows_the_largest_request_and_only_rises():
    assert _probe(str(300 << 20))["kept"] == 300 << 20
    assert _probe(f"{300 << 20},{100 << 20}")["kept"] == 300 << 20
    assert _probe(str(2**40))["kept"] == 2**31 - 1  # mallopt takes an int


def test_opting_out_leaves_glibc_as_it_is_and_a_bad_switch_is_named():
    off = _probe("0", JBATCH_KEEP_HOST_PAGES="0")
    assert off["kept"] == 0 and off["mapped"] >= 40 << 20
    bad = _run_probe("0", JBATCH_KEEP_HOST_PAGES="yes")
    assert bad.returncode != 0 and "JBATCH_KEEP_HOST_PAGES must be 0 or 1, got 'yes'" in bad.stderr


def test_a_cpu_engine_keeps_room_for_its_largest_program_temporaries(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    script = textwrap.dedent(
        """
        import json, sys
        from jbatch import LLM
        from jbatch.engine import engine_core, host_memory
        llm = LLM(sys.argv[1], max_slots=4, num_pages=16, max_num_batched_tokens=32,
                  max_seq_len=64)
        largest = engine_core._largest_temp(llm.engine.core._ready.values())
        print(json.dumps(dict(kept=host_memory.kept(), largest=largest)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["largest"] > 0
    assert got["kept"] == (64 << 20) + got["largest"]
