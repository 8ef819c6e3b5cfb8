"""Where the persistent compilation cache goes, and that tests never turn it on unasked."""

from __future__ import annotations

import jax
import pytest

from jbatch import compile_cache


def test_off_unless_asked(monkeypatch, restore_jax_cache_config):
    before = jax.config.jax_compilation_cache_dir
    assert compile_cache.from_env() is None  # conftest: JBATCH_COMPILATION_CACHE=off
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.from_env() is None  # LLM's call: no default directory
    assert jax.config.jax_compilation_cache_dir == before


def test_env_and_serve_default(monkeypatch, tmp_path, restore_jax_cache_config):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == tmp_path / "xdg" / "jbatch" / "xla"
    monkeypatch.delenv(compile_cache.ENV)
    got = compile_cache.from_env(compile_cache.default_dir())  # serve without the variable
    assert got == tmp_path / "xdg" / "jbatch" / "xla" and got.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(got)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "moved"))
    assert compile_cache.from_env(compile_cache.default_dir()) == tmp_path / "moved"
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.from_env(compile_cache.default_dir()) is None


def test_the_cache_is_bounded_unless_jax_was_told(monkeypatch, tmp_path, restore_jax_cache_config):
    """``enable`` caps JAX's cache (and so the executable store) at DEFAULT_MAX_BYTES; a size
    JAX was given, by its config or its environment variable (-1 too), is left alone."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
    jax.config.update("jax_compilation_cache_max_size", -1)
    compile_cache.enable(tmp_path / "a")
    assert jax.config.jax_compilation_cache_max_size == compile_cache.DEFAULT_MAX_BYTES
    jax.config.update("jax_compilation_cache_max_size", 12345)
    compile_cache.enable(tmp_path / "b")
    assert jax.config.jax_compilation_cache_max_size == 12345
    jax.config.update("jax_compilation_cache_max_size", -1)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")  # "no limit", said explicitly
    compile_cache.enable(tmp_path / "c")
    assert jax.config.jax_compilation_cache_max_size == -1


def test_entries_of_an_unbounded_cache_are_dated_so_jax_can_evict(
    tmp_path, monkeypatch, restore_jax_cache_config
):
    """A cache filled while unbounded (before jbatch bounded it) has no access-time files; JAX's
    bounded cache needs one per entry to evict, and without it every write fails. ``enable``
    dates them, and JAX's own cache then evicts the old entry to store a new one."""
    from jax._src.lru_cache import LRUCache  # JAX's cache class, exercised as JAX uses it

    monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
    jax.config.update("jax_compilation_cache_max_size", -1)
    (tmp_path / "old-cache").write_bytes(b"x" * 100)  # as an unbounded cache leaves it
    with pytest.raises(FileNotFoundError):
        LRUCache(str(tmp_path), max_size=120).put("new", b"y" * 50)  # what enable prevents
    assert not (tmp_path / "new-cache").exists()
    compile_cache.enable(tmp_path)
    assert (tmp_path / "old-atime").exists()
    assert compile_cache.date_entries(tmp_path) == 0  # once
    LRUCache(str(tmp_path), max_size=120).put("new", b"y" * 50)
    assert (tmp_path / "new-cache").exists() and not (tmp_path / "old-cache").exists()


def test_commands_cache_by_default_unless_told(
    monkeypatch, tmp_path, caplog, restore_jax_cache_config
):
    """``jbatch generate / serve / batch``: the flag, else the variable, else the default
    directory; a directory the user named that cannot be made is an error naming it, the
    default one only turns the cache off (a read-only home must not stop the demo)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.for_cli(None) == tmp_path / "xdg" / "jbatch" / "xla"
    assert compile_cache.for_cli(str(tmp_path / "flag")) == tmp_path / "flag"
    assert compile_cache.for_cli("off") is None
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.for_cli(None) == tmp_path / "env"
    assert compile_cache.for_cli(str(tmp_path / "flag")) == tmp_path / "flag"  # the flag wins
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.for_cli(None) is None
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"--compilation-cache .*a_file/x: cannot use it"):
        compile_cache.for_cli(str(tmp_path / "a_file" / "x"))
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "a_file" / "y"))
    with pytest.raises(ValueError, match=rf"{compile_cache.ENV} .*a_file/y: cannot use it"):
        compile_cache.for_cli(None)
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a_file"))  # no home to write into
    with caplog.at_level("WARNING", logger="jbatch.compile_cache"):
        assert compile_cache.for_cli(None) is None
    assert "compilation cache off: cannot create" in caplog.text
