import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JBATCH_COMPILATION_CACHE", "off")  # never write into the user's home
# Most of the suite's time is XLA:CPU compiling step programs: at backend optimisation level 0 a
# test model's ten programs build in ~23 s instead of ~43 s, and then run ~1.8x slower (the
# tests' runs are short). The subprocess workers set the same; benchmarks and users run at
# XLA's default. Every engine a test compares is compiled the same way.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=0".strip()

import pytest  # noqa: E402 (after the environment above)

from tests.hf_models import make_checkpoint  # noqa: E402

_JAX_CACHE_OPTIONS = (
    "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size",
)  # fmt: skip


@pytest.fixture
def restore_jax_cache_config():
    """Put back JAX's persistent-cache options (directory, thresholds, size) a test changed."""
    import jax

    old = {n: getattr(jax.config, n) for n in _JAX_CACHE_OPTIONS}
    yield
    for n, v in old.items():
        jax.config.update(n, v)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: ``hf_checkpoint(name) -> (path, torch_model)``, built once per session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"hf_{name}")
            cache[name] = (path, make_checkpoint(name, path))
        return cache[name]

    return get
