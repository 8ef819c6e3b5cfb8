import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JBATCH_COMPILATION_CACHE", "off")  # never write into the user's home

import pytest

from tests.hf_models import make_checkpoint


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
