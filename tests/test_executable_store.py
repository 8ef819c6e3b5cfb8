"""The executable store (jbatch/engine/executable_store.py): a second engine of the same model
and config loads every step program from disk (no tracing, no compile) and produces the same
tokens; anything that changes a program changes its key; a torn file is dropped and rebuilt."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jbatch import LLM, SamplingParams
from jbatch.demo import demo_model_path
from jbatch.engine import executable_store
from jbatch.engine.executable_store import ExecutableStore, digest, signature
from tests.compile_counter import count_compiles

SMALL = dict(max_slots=2, max_num_batched_tokens=16, num_pages=16, max_seq_len=64)
ROOT = Path(__file__).resolve().parents[1]
FROM_CACHE = ExecutableStore.from_compilation_cache  # before the fixture below replaces it
PROMPTS = ["The cat sat on the", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("executables")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExecutableStore, "from_compilation_cache", classmethod(lambda c: c(directory)))
        yield directory


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def first(store_dir):
    llm = LLM(str(demo_model_path()), **SMALL)
    return llm, _tokens(llm)


def test_a_second_engine_loads_every_step_program_and_compiles_none(store_dir, first):
    llm, tokens = first
    programs = len(llm.engine.core.layouts)
    filled = {"loaded": 0, "compiled": programs, "stored": programs}
    assert llm.engine.core.warmup_programs == filled
    assert len(list(store_dir.glob("*.jaxexe"))) == programs
    with count_compiles() as compiled:
        again = LLM(str(demo_model_path()), **SMALL)
    assert again.engine.core.warmup_programs == {"loaded": programs, "compiled": 0, "stored": 0}
    assert not [name for name in compiled if "run" in name], compiled  # no step program
    assert _tokens(again) == tokens


def test_a_torn_file_is_dropped_and_compiled_again(store_dir, first):
    llm, tokens = first
    victim = sorted(store_dir.glob("*.jaxexe"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    again = LLM(str(demo_model_path()), **SMALL)
    programs = len(llm.engine.core.layouts)
    assert again.engine.core.warmup_programs == {"loaded": programs - 1, "compiled": 1, "stored": 1}
    assert victim.stat().st_size > 100  # rewritten whole
    assert _tokens(again) == tokens


def test_a_stored_program_that_does_not_run_is_dropped_and_compiled(store_dir, first, monkeypatch):
    """A program that loads but fails at warm-up (here: another bucket's, as if its key had
    missed what made it) costs a compile, never a failed start or a wrong program."""
    llm, tokens = first
    real_load = ExecutableStore.load
    keys = sorted(p.stem for p in store_dir.glob("*.jaxexe"))

    def wrong(self, key, devices):
        other = keys[(keys.index(key) + 1) % len(keys)] if key in keys else key
        return real_load(self, other, devices)

    monkeypatch.setattr(ExecutableStore, "load", wrong)
    again = LLM(str(demo_model_path()), **SMALL)
    n = len(llm.engine.core.layouts)
    assert again.engine.core.warmup_programs == {"loaded": 0, "compiled": n, "stored": n}
    assert _tokens(again) == tokens


def test_whatever_changes_a_program_changes_its_key(first, monkeypatch):
    llm, _ = first
    engine = llm.engine
    core, params = engine.core, engine.params
    inp = core.new_input(*next(iter(core.layouts)))
    key = core._store_key(params, engine.state, inp)
    assert core._store_key(params, engine.state, inp) == key  # deterministic
    other = core.new_input(*list(core.layouts)[1])
    assert core._store_key(params, engine.state, other) != key  # another bucket
    # a field of the engine config, of the model config
    changed = {
        "cfg": dataclasses.replace(core.cfg, aging_steps=7),
        "model_cfg": dataclasses.replace(core.model_cfg, rms_norm_eps=1e-3),
    }
    for field, cfg in changed.items():
        monkeypatch.setattr(core, field, cfg)
        assert core._store_key(params, engine.state, inp) != key, field
        monkeypatch.undo()
    # the sources
    monkeypatch.setattr(executable_store, "source_fingerprint", lambda: "edited")
    assert core._store_key(params, engine.state, inp) != key
    monkeypatch.undo()
    # the arguments: a dtype, a weak type, a placement, a shape
    x = jnp.zeros(3, jnp.float32)
    base = signature(x)
    assert signature(x.astype(jnp.bfloat16)) != base
    assert signature(jnp.asarray(0.0)) != signature(jnp.zeros((), jnp.float32))
    assert signature(np.zeros(3, np.float32)) != base  # host numpy vs committed device array
    assert signature(jnp.zeros(4, jnp.float32)) != base
    assert digest("a", 1) != digest("a", 2)


def _start(cache: Path, store: str) -> dict:
    cmd = [sys.executable, "-m", "tests.store_worker", str(cache), store]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_program_from_jaxs_persistent_cache_is_not_stored(tmp_path, first):
    """XLA:CPU cannot serialize an executable that was itself deserialized (the copy fails to
    run): a start whose programs come from JAX's persistent cache stores none, and the next
    start compiles (from that cache) and runs as before instead of loading a broken copy."""
    _, tokens = first
    filled = _start(tmp_path, "off")  # JAX's cache only
    assert filled["programs"]["compiled"] > 0 and filled["tokens"] == tokens
    for _ in range(2):
        again = _start(tmp_path, "on")
        assert again["programs"]["loaded"] == again["programs"]["stored"] == 0, again
        assert again["tokens"] == tokens


def test_the_store_follows_jaxs_cache_dir_only_when_it_is_local(tmp_path, restore_jax_cache_config):
    for where, expected in ((None, None), ("gs://bucket/xla", None), (str(tmp_path), True)):
        jax.config.update("jax_compilation_cache_dir", where)
        store = FROM_CACHE()
        if expected is None:
            assert store is None, where
        else:
            assert store.directory == tmp_path / executable_store.SUBDIR


def _tiny_program() -> jax.stages.Compiled:
    return jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(4, jnp.float32)).compile()


def test_the_least_recently_used_programs_go_when_the_store_is_full(tmp_path):
    """Bounded like JAX's cache: a save evicts the oldest-used files until the directory fits
    (never the one saved), a load counts as a use, and a program over the whole budget is not
    stored."""
    import os

    program = _tiny_program()
    store = ExecutableStore(tmp_path)
    assert store.save("used", program)
    size = store._path("used").stat().st_size
    for i in range(3):  # older files than "used", except one loaded later
        (tmp_path / f"old{i}{executable_store.SUFFIX}").write_bytes(b"x" * size)
        os.utime(tmp_path / f"old{i}{executable_store.SUFFIX}", (1000 + i, 1000 + i))
    os.utime(store._path("used"), (999, 999))  # the oldest of all, until it is loaded
    bounded = ExecutableStore(tmp_path, max_bytes=3 * size)
    assert bounded.load("used", jax.devices()[:1]) is not None  # touched: now the newest
    assert bounded.save("new", program)
    left = sorted(p.stem for p in tmp_path.glob(f"*{executable_store.SUFFIX}"))
    assert left == ["new", "old2", "used"]  # old0 and old1 (least recently used) went
    assert np.array_equal(bounded.load("new", jax.devices()[:1])(jnp.ones(4)), np.full(4, 3.0))
    tiny = ExecutableStore(tmp_path / "tiny", max_bytes=size // 2)
    assert not tiny.save("big", program)
    assert not list((tmp_path / "tiny").glob("*"))
    with pytest.raises(ValueError, match="max_bytes"):
        ExecutableStore(tmp_path, max_bytes=0)


def test_the_store_takes_jaxs_cache_size_limit(tmp_path, restore_jax_cache_config):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    for limit, expected in ((-1, None), (5 << 20, 5 << 20)):
        jax.config.update("jax_compilation_cache_max_size", limit)
        assert FROM_CACHE().max_bytes == expected
    jax.config.update("jax_compilation_cache_max_size", 0)  # JAX's "caching off"
    assert FROM_CACHE() is None
