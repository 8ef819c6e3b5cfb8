"""Paged attention implementations against a dense numpy oracle and each other."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention, paged_attention_reference, paged_attention_xla


def dense_oracle(q, k_seq, v_seq, positions, window):
    """Per query row, softmax over that sequence's keys 0..pos (numpy, float64)."""
    n, bq, h, d = q.shape
    kvh = k_seq.shape[2]
    out = np.zeros((n, bq, h, d))
    for i in range(n):
        for j in range(bq):
            p = positions[i, j]
            if p < 0:
                continue
            lo = 0 if window is None else max(0, p - window + 1)
            for head in range(h):
                kh = head // (h // kvh)
                keys = k_seq[i, lo : p + 1, kh].astype(np.float64)
                s = keys @ q[i, j, head].astype(np.float64) / np.sqrt(d)
                w = np.exp(s - s.max())
                out[i, j, head] = (w / w.sum()) @ v_seq[i, lo : p + 1, kh]
    return out


def make_case(rng, *, n, bq, h, kvh, d, page_size, num_pages, max_pages, dtype=np.float32):
    """Random sequences written into a NaN-filled pool through scrambled page tables."""
    lens = rng.randint(1, max_pages * page_size + 1, n)
    perm = rng.permutation(num_pages)[: n * max_pages].reshape(n, max_pages)
    k_pool = np.full((num_pages, page_size, kvh, d), np.nan, dtype)
    v_pool = np.full((num_pages, page_size, kvh, d), np.nan, dtype)
    k_seq = rng.randn(n, max_pages * page_size, kvh, d).astype(dtype)
    v_seq = rng.randn(n, max_pages * page_size, kvh, d).astype(dtype)
    positions = np.full((n, bq), -1, np.int32)
    for i in range(n):
        for t in range(lens[i]):
            k_pool[perm[i, t // page_size], t % page_size] = k_seq[i, t]
            v_pool[perm[i, t // page_size], t % page_size] = v_seq[i, t]
        qn = rng.randint(1, min(bq, lens[i]) + 1)  # the block's queries are the last qn tokens
        positions[i, :qn] = np.arange(lens[i] - qn, lens[i])
    q = rng.randn(n, bq, h, d).astype(dtype)
    # Unused page-table entries point at random (NaN or other sequences') pages.
    for i in range(n):
        used = -(-lens[i] // page_size)
        perm[i, used:] = rng.randint(0, num_pages, max_pages - used)
    return q, k_pool, v_pool, perm.astype(np.int32), positions, k_seq, v_seq


CASES = [
    dict(n=3, bq=1, h=4, kvh=4, d=16, page_size=4, num_pages=40, max_pages=6),
    dict(n=2, bq=8, h=8, kvh=2, d=32, page_size=16, num_pages=12, max_pages=4),
    dict(n=4, bq=4, h=6, kvh=1, d=8, page_size=8, num_pages=64, max_pages=9),
    dict(n=16, bq=1, h=6, kvh=2, d=16, page_size=4, num_pages=256, max_pages=12),  # decode rows
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fn", [paged_attention_reference, paged_attention_xla])
def test_matches_dense_oracle_with_nan_pages(case, window, fn):
    rng = np.random.RandomState(hash((tuple(case.values()), window)) % 2**31)
    q, kp, vp, tables, pos, k_seq, v_seq = make_case(rng, **case)
    kwargs = dict(sliding_window=window)
    if fn is paged_attention_xla:
        kwargs["chunk_tokens"] = 2 * case["page_size"]  # several loop iterations
    got = np.asarray(
        fn(
            jnp.asarray(q),
            jnp.asarray(kp),
            jnp.asarray(vp),
            jnp.asarray(tables),
            jnp.asarray(pos),
            **kwargs,
        )
    )
    want = dense_oracle(q, k_seq, v_seq, pos, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    assert (got[pos < 0] == 0).all(), "padding rows must be exactly zero"


@pytest.mark.parametrize("window", [None, 7])
def test_decode_rows_one_long_among_short_and_padding(window):
    """Decode rows share each loop iteration's chunks whichever rows own them: one long row
    among short ones, padding rows (-1) and a soft cap must still give every row its own
    softmax (padding rows exactly zero)."""
    rng = np.random.RandomState(7)
    page_size, max_pages, kvh, d = 4, 16, 2, 8
    pos = np.array([[max_pages * page_size - 1], [2], [0], [-1], [5], [3], [-1], [1]], np.int32)
    n = len(pos)
    tables = rng.permutation(160)[: n * max_pages].reshape(n, max_pages).astype(np.int32)
    k_seq = rng.randn(n, max_pages * page_size, kvh, d).astype(np.float32)
    v_seq = rng.randn(n, max_pages * page_size, kvh, d).astype(np.float32)
    kp = np.full((160, page_size, kvh, d), np.nan, np.float32)
    vp = np.full_like(kp, np.nan)
    for i in range(n):
        for t in range(pos[i, 0] + 1):  # only keys 0..pos are written: the rest stays NaN
            kp[tables[i, t // page_size], t % page_size] = k_seq[i, t]
            vp[tables[i, t // page_size], t % page_size] = v_seq[i, t]
    q = rng.randn(n, 1, 4, d).astype(np.float32)
    args = [jnp.asarray(x) for x in (q, kp, vp, tables, pos)]
    got = np.asarray(paged_attention_xla(*args, sliding_window=window, chunk_tokens=8))
    np.testing.assert_allclose(
        got, dense_oracle(q, k_seq, v_seq, pos, window), atol=2e-5, rtol=1e-4
    )
    assert (got[pos < 0] == 0).all()
    capped = np.asarray(paged_attention_xla(*args, soft_cap=2.0, chunk_tokens=8))
    ref = np.asarray(paged_attention_reference(*args, soft_cap=2.0))
    np.testing.assert_allclose(capped, ref, atol=2e-5, rtol=1e-4)


def test_bf16_xla_matches_reference():
    rng = np.random.RandomState(0)
    q, kp, vp, tables, pos, *_ = make_case(
        rng, n=4, bq=2, h=8, kvh=2, d=64, page_size=8, num_pages=48, max_pages=8
    )
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, kp, vp)] + [
        jnp.asarray(tables),
        jnp.asarray(pos),
    ]
    ref = np.asarray(paged_attention_reference(*args), np.float32)
    got = np.asarray(paged_attention_xla(*args, chunk_tokens=24), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_dispatch_rejects_unknown_impl():
    q = jnp.zeros((1, 1, 2, 4))
    pool = jnp.zeros((2, 4, 1, 4))
    with pytest.raises(ValueError, match="'triton'"):
        paged_attention(
            q, pool, pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32), impl="triton"
        )
