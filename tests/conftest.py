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
