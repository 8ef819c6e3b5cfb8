"""The native CPU attention kernel (``pallas_kernels.cpu_attention``) against the dense numpy
oracle and the JAX reference: scrambled page tables, NaN-filled unused pages, every head size it
specializes, sliding windows, soft caps, bf16 and 8-bit pools, speculative blocks with padding
rows; and how the dispatcher routes to it."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    cpu_attention,
    dispatch,
    paged_attention,
    paged_attention_reference,
    resolve_impl,
)
from pallas_kernels.kv_quant import quantize
from tests.test_paged_attention import dense_oracle, make_case

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason=f"no CPU kernel: {cpu_attention.unavailable_reason()}"
)

CASES = [
    dict(n=3, bq=1, h=4, kvh=4, d=16, page_size=4, num_pages=40, max_pages=6),
    dict(n=16, bq=1, h=9, kvh=3, d=64, page_size=16, num_pages=200, max_pages=8),  # SmolLM2
    dict(n=4, bq=5, h=6, kvh=1, d=32, page_size=8, num_pages=64, max_pages=9),  # spec groups
    dict(n=2, bq=1, h=4, kvh=2, d=128, page_size=16, num_pages=12, max_pages=4),
    dict(n=2, bq=3, h=2, kvh=1, d=256, page_size=4, num_pages=20, max_pages=5),
    dict(n=3, bq=2, h=4, kvh=2, d=24, page_size=4, num_pages=30, max_pages=6),  # generic size
    dict(n=4, bq=16, h=9, kvh=3, d=64, page_size=16, num_pages=64, max_pages=5),  # prompt blocks
]


def _run(q, kp, vp, tables, pos, **kw):
    args = [jnp.asarray(x) for x in (q, kp, vp, tables, pos)]
    fn = jax.jit(functools.partial(cpu_attention.cpu_paged_attention, **kw))
    return np.asarray(fn(*args), np.float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c['n']}bq{c['bq']}d{c['d']}")
@pytest.mark.parametrize("window", [None, 5])
def test_matches_dense_oracle_with_nan_pages(case, window):
    rng = np.random.RandomState(hash((tuple(case.values()), window)) % 2**31)
    q, kp, vp, tables, pos, k_seq, v_seq = make_case(rng, **case)
    got = _run(q, kp, vp, tables, pos, sliding_window=window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, dense_oracle(q, k_seq, v_seq, pos, window), atol=2e-5)
    assert (got[pos < 0] == 0).all(), "padding rows must be exactly zero"


@pytest.mark.parametrize("window", [None, 5])
def test_calls_shared_with_xla_threads_or_not_give_the_same_bits(window):
    """A call shares its items with XLA's threads only from ``MIN_PARALLEL_WORK``: forced either
    way, the result is bit for bit the same; the default sends the oracle test's smallest case
    down the calling thread alone and its SmolLM2 case across the pool."""
    rng = np.random.RandomState(7)
    case = CASES[1]
    q, kp, vp, tables, pos, k_seq, v_seq = make_case(rng, **case)
    shared, alone = (
        _run(q, kp, vp, tables, pos, sliding_window=window, min_parallel_work=w) for w in (0, 2**62)
    )
    np.testing.assert_array_equal(shared, alone)
    np.testing.assert_allclose(alone, dense_oracle(q, k_seq, v_seq, pos, window), atol=2e-5)

    def work(c):  # the kernel's measure for the oracle test's draw of case c (no window)
        seed = hash((tuple(c.values()), None)) % 2**31
        positions = make_case(np.random.RandomState(seed), **c)[4]
        return int((positions + 1)[positions >= 0].sum()) * c["h"] * c["d"]

    assert work(CASES[0]) < cpu_attention.MIN_PARALLEL_WORK <= work(CASES[1])


def test_scale_soft_cap_and_padding_anywhere():
    """Gemma's options, padding rows between valid ones and one block with no valid row."""
    rng = np.random.RandomState(3)
    q, kp, vp, tables, pos, *_ = make_case(
        rng, n=5, bq=4, h=8, kvh=2, d=64, page_size=8, num_pages=80, max_pages=6
    )
    pos[1] = [-1, 9, -1, 10]
    pos[4] = -1
    args = [jnp.asarray(x) for x in (q, kp, vp, tables, pos)]
    for kw in (dict(soft_cap=1.5), dict(scale=0.3, soft_cap=50.0), dict(sliding_window=3)):
        got = _run(q, kp, vp, tables, pos, **kw)
        want = np.asarray(paged_attention_reference(*args, **kw))
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=str(kw))
        assert (got[pos < 0] == 0).all()


def test_bf16_query_and_pool():
    rng = np.random.RandomState(5)
    q, kp, vp, tables, pos, *_ = make_case(
        rng, n=6, bq=1, h=8, kvh=2, d=64, page_size=16, num_pages=60, max_pages=6
    )
    kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)  # bf16 NaN pages: the reference zeroes them
    for q_dt, pool_dt in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16)):
        args = [jnp.asarray(q, q_dt), jnp.asarray(kp, pool_dt), jnp.asarray(vp, pool_dt)]
        args += [jnp.asarray(tables), jnp.asarray(pos)]
        got = jax.jit(cpu_attention.cpu_paged_attention)(*args)
        assert got.dtype == q_dt
        want = paged_attention_reference(*args)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
        )


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_8bit_pool_with_scales(dtype):
    rng = np.random.RandomState(11)
    q, kp, vp, tables, pos, *_ = make_case(
        rng, n=6, bq=2, h=6, kvh=3, d=64, page_size=8, num_pages=60, max_pages=6
    )
    (kq, ks), (vq, vs) = (quantize(jnp.asarray(np.nan_to_num(x)), dtype) for x in (kp, vp))
    ks = jnp.where(jnp.isnan(jnp.asarray(kp[..., 0])), jnp.nan, ks)  # unused pages: NaN scales
    args = [jnp.asarray(q), kq, vq, jnp.asarray(tables), jnp.asarray(pos)]
    got = jax.jit(cpu_attention.cpu_paged_attention)(*args, k_scales=ks, v_scales=vs)
    want = paged_attention_reference(*args, k_scales=ks, v_scales=vs)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_errors_name_the_bad_value():
    q = jnp.zeros((1, 1, 2, 16))
    pool = jnp.zeros((2, 4, 1, 16), jnp.float16)
    tables, pos = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="float16"):
        cpu_attention.cpu_paged_attention(q, pool, pool, tables, pos)
    with pytest.raises(ValueError, match="float16"):
        paged_attention(q, pool, pool, tables, pos, impl="cpu")
    assert resolve_impl("auto", q, pool) == "xla"  # auto falls back where the kernel cannot go
    pool8 = jnp.zeros((2, 4, 1, 16), jnp.int8)
    with pytest.raises(ValueError, match="k_scales"):
        cpu_attention.cpu_paged_attention(q, pool8, pool8, tables, pos)


def test_dispatch_routes_small_blocks_to_the_kernel_and_prompt_blocks_by_their_keys():
    """Small blocks always take the kernel; prompt blocks take it while no row sees more than
    MAX_PROMPT_KEYS keys and XLA's chunked dots beyond, a choice made at run time: one program,
    both branches in it, each checked against the reference (the long case's rows see up to
    MAX_PROMPT_KEYS + 64 keys)."""
    assert resolve_impl("auto") == (
        "cpu" if jax.default_backend() == "cpu" else resolve_impl("auto")
    )
    rng = np.random.RandomState(2)
    limit = cpu_attention.MAX_PROMPT_KEYS
    for bq, max_pages in ((1, 5), (cpu_attention.MAX_BLOCK_Q, 5), (16, 5), (16, limit // 8 + 8)):
        q, kp, vp, tables, pos, *_ = make_case(
            rng, n=3, bq=bq, h=4, kvh=2, d=32, page_size=8, num_pages=3 * max_pages + 8,
            max_pages=max_pages,
        )  # fmt: skip
        if max_pages > 5:  # the long case: block 0's rows see past the limit, all finite keys
            pos[0] = np.arange(limit + 64 - bq, limit + 64)
            for pool in (kp, vp):
                pages = pool[tables[0]]
                pool[tables[0]] = np.where(np.isnan(pages), rng.randn(*pages.shape), pages)
        args = [jnp.asarray(x) for x in (q, kp, vp, tables, pos)]
        fn = jax.jit(lambda *a: paged_attention(*a, impl="cpu"))
        hlo = fn.lower(*args).as_text()
        assert cpu_attention.TARGET in hlo, bq
        assert ("stablehlo.case" in hlo) == (bq > cpu_attention.MAX_BLOCK_Q), bq  # the choice
        want, got = paged_attention_reference(*args), np.asarray(fn(*args))
        assert np.isfinite(got).all(), bq
        np.testing.assert_allclose(got, np.asarray(want), atol=2e-5)
    keys = np.asarray([[limit - 1, -1], [3, 4]])  # positions: the last row sees `limit` keys
    assert int(dispatch.prompt_keys(jnp.asarray(keys), None)) == limit
    assert int(dispatch.prompt_keys(jnp.asarray(keys), 7)) == 7


def test_switch_off_falls_back_to_xla_and_explicit_cpu_names_why():
    code = (
        "from pallas_kernels import cpu_attention, resolve_impl\n"
        "assert not cpu_attention.available()\n"
        "assert resolve_impl('auto') == 'xla'\n"
        "try:\n    resolve_impl('cpu')\nexcept ValueError as e:\n    print(e)\n"
    )
    env = dict(os.environ, JBATCH_CPU_ATTENTION="0", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "JBATCH_CPU_ATTENTION=0" in done.stdout
