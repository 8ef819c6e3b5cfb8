"""The CPU engine's ``[E, V]`` LM head copy (``jbatch/models/lm_head.py``): the logits it gives
are the ``[V, E]`` head's, for float and int8 heads, and it is made only within its budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jbatch.checkpoint import load_model
from jbatch.demo import demo_model_path
from jbatch.models import lm_head, quant
from jbatch.models.llama import compute_logits


@pytest.fixture(scope="module")
def demo():
    return load_model(demo_model_path())  # tied embeddings


@pytest.mark.parametrize("int8", [False, True])
def test_the_copy_gives_the_heads_logits(demo, int8):
    cfg, params = demo
    if int8:
        q, s = quant.quantize(np.asarray(params["embed"]), axis=-1)  # per vocab row
        params = {**params, "embed": jnp.asarray(q), "embed_scale": jnp.asarray(s)}
    with_copy = lm_head.with_cpu_head(params)
    assert with_copy[lm_head.HEAD_T].shape == params["embed"].shape[::-1]
    np.testing.assert_array_equal(with_copy[lm_head.HEAD_T], np.asarray(params["embed"]).T)
    assert (quant.scale_key(lm_head.HEAD_T) in with_copy) == int8
    hidden = jax.random.normal(jax.random.key(0), (5, cfg.hidden_size))
    want = np.asarray(compute_logits(params, hidden, cfg))
    got = np.asarray(compute_logits(with_copy, hidden, cfg))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_no_copy_past_the_budget_or_twice(demo, monkeypatch):
    _, params = demo
    once = lm_head.with_cpu_head(params)
    assert lm_head.with_cpu_head(once) is once
    monkeypatch.setattr(lm_head, "COPY_MAX_BYTES", params["embed"].nbytes - 1)
    assert lm_head.HEAD_T not in lm_head.with_cpu_head(params)
