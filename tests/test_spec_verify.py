"""The speculative verifier on its own (``engine/spec_verify.py``) and the n-gram proposer:
greedy exactness, the emitted tokens' distribution (chi-square, which a biased acceptor fails),
determinism, and rows without proposals sampling exactly as the ordinary sampler."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jbatch.engine import ngram_proposer
from jbatch.engine.sampler import SlotSampling, sample
from jbatch.engine.spec_verify import verify

VOCAB, K = 6, 3


def sampling(n: int, temperature: float, seeds, top_k: int = 0) -> SlotSampling:
    sp = SlotSampling.neutral(n)
    return sp.replace(
        temperature=jnp.full((n,), temperature, jnp.float32),
        top_k=jnp.full((n,), top_k, jnp.int32),
        seed=jnp.asarray(seeds, jnp.uint32),
    )


@functools.partial(jax.jit, static_argnames="bias")
def _verify(x, drafts, num_drafts, sp, step, q=None, bias=0.0):
    return verify(x, drafts, num_drafts, sp, step, q, accept_bias=bias)


def test_greedy_accepts_the_matching_prefix_and_emits_the_target_chain():
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(4, K + 1, VOCAB), jnp.float32)
    target = np.asarray(jnp.argmax(x, -1))  # [G, K+1]
    drafts = target[:, :K].copy()
    drafts[1, 1] = (drafts[1, 1] + 1) % VOCAB  # group 1: accept 1, then reject
    drafts[2, 0] = (drafts[2, 0] + 1) % VOCAB  # group 2: reject at once
    num = jnp.asarray([3, 3, 3, 2], jnp.int32)  # group 3: two proposals, both right
    emitted, count = _verify(
        x, jnp.asarray(drafts), num, sampling(4, 0.0, [0] * 4), jnp.zeros(4, jnp.int32)
    )
    emitted, count = np.asarray(emitted), np.asarray(count)
    assert count.tolist() == [4, 2, 1, 3]
    for g in range(4):
        assert emitted[g, : count[g]].tolist() == target[g, : count[g]].tolist()


def _draws(x, drafts, num, temperature, n, bias=0.0, q=None, top_k=0):
    """``n`` independent verifications of one group (seeds 0..n-1): emitted [n, K+1], counts."""
    rep = lambda a: jnp.broadcast_to(a, (n, *a.shape[1:]))
    sp = sampling(n, temperature, np.arange(n), top_k)
    qq = None if q is None else rep(q)
    e, c = _verify(rep(x), rep(drafts), rep(num), sp, jnp.full((n,), 5, jnp.int32), qq, bias)
    return np.asarray(e), np.asarray(c)


def _chi2_pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=len(p))
    p = np.asarray(p, np.float64)
    keep = p > 0
    p = p / p[keep].sum()
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    return stats.chisquare(observed[keep], p[keep] * observed.sum()).pvalue


@pytest.mark.parametrize("proposal", ["point", "draft"])
def test_emitted_tokens_keep_the_target_distribution(proposal):
    """First emitted token ~ p_0 and, given it equals d_1, the second ~ p_1 — whatever was
    proposed (a point mass like the n-gram proposer, or draws of a draft distribution q)."""
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.randn(1, K + 1, VOCAB) * 1.5, jnp.float32)
    p = np.asarray(jax.nn.softmax(x[0] / 0.8, axis=-1))  # temperature 0.8
    n = 60_000
    if proposal == "point":
        drafts = jnp.asarray([[int(np.argsort(p[0])[-2]), 1, 2]], jnp.int32)  # not the mode
        q = None
        e, c = _draws(x, drafts, jnp.asarray([K], jnp.int32), 0.8, n)
    else:
        qd = jax.nn.softmax(jnp.asarray(rng.randn(K, VOCAB), jnp.float32), -1)  # [K, V]
        d = jax.random.categorical(jax.random.key(3), jnp.log(qd), shape=(n, K)).astype(jnp.int32)
        sp = sampling(n, 0.8, np.arange(n))
        rep = lambda a: jnp.broadcast_to(a, (n, *a.shape[1:]))
        e, c = _verify(
            rep(x), d, jnp.full((n,), K, jnp.int32), sp, jnp.full((n,), 5, jnp.int32), rep(qd[None])
        )
        e, c, drafts, q = np.asarray(e), np.asarray(c), np.asarray(d), qd
    assert _chi2_pvalue(e[:, 0], p[0]) > 1e-3
    first_ok = e[:, 0] == (np.asarray(drafts)[:, 0] if q is not None else int(drafts[0, 0]))
    second = e[first_ok & (c >= 2), 1]
    assert len(second) > 2000
    assert _chi2_pvalue(second, p[1]) > 1e-3
    assert c.min() >= 1 and c.max() == K + 1  # some runs accept everything (+ a bonus token)


def test_a_biased_acceptor_fails_the_distribution_test():
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.randn(1, K + 1, VOCAB) * 1.5, jnp.float32)
    p = np.asarray(jax.nn.softmax(x[0] / 0.8, axis=-1))
    drafts = jnp.asarray([[int(np.argsort(p[0])[-2]), 1, 2]], jnp.int32)
    e, _ = _draws(x, drafts, jnp.asarray([K], jnp.int32), 0.8, 60_000, bias=0.15)
    assert _chi2_pvalue(e[:, 0], p[0]) < 1e-6


def test_seeded_verification_is_deterministic_and_filters_hold():
    rng = np.random.RandomState(2)
    x = jnp.asarray(rng.randn(1, K + 1, VOCAB), jnp.float32)
    drafts = jnp.asarray([[0, 1, 2]], jnp.int32)
    a = _draws(x, drafts, jnp.asarray([K], jnp.int32), 1.0, 500, top_k=2)
    b = _draws(x, drafts, jnp.asarray([K], jnp.int32), 1.0, 500, top_k=2)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    top2 = np.argsort(np.asarray(x[0]), axis=-1)[:, -2:]  # [K+1, 2] allowed per row
    e, c = a
    for i in range(K + 1):
        rows = e[c > i, i]
        assert np.isin(rows, top2[i]).all(), "a token outside top-k was emitted"


def test_a_group_without_proposals_samples_exactly_like_the_sampler():
    rng = np.random.RandomState(3)
    n = 64
    logits = jnp.asarray(rng.randn(n, VOCAB), jnp.float32)
    sp = sampling(n, 0.9, rng.randint(0, 2**31, n), top_k=4)
    step = jnp.asarray(rng.randint(0, 100, n), jnp.int32)
    zeros = jnp.zeros((n, VOCAB), jnp.int32)
    want, _ = sample(logits, sp, step, zeros.astype(bool), zeros)
    x = jnp.concatenate([logits[:, None], jnp.zeros((n, K, VOCAB))], axis=1)
    e, c = _verify(x, jnp.zeros((n, K), jnp.int32), jnp.zeros(n, jnp.int32), sp, step)
    assert np.asarray(c).tolist() == [1] * n
    assert np.asarray(e)[:, 0].tolist() == np.asarray(want).tolist()


def test_ngram_proposer_finds_the_latest_match_with_room():
    stream = np.asarray([5, 6, 7, 8, 9, 1, 5, 6, 7, 3, 4, 2, 5, 6, 7], np.int32)
    # "5 6 7" occurs at 0 and 6; the latest one with 3 tokens after it is at 6 -> 3 4 2.
    assert ngram_proposer.propose(stream, 3, 2, 3) == [3, 4, 2]
    assert ngram_proposer.propose(stream, 7, 2, 3) == [8, 9, 1, 5, 6, 7, 3]  # only 0 has 7 after
    assert ngram_proposer.propose(np.asarray([1, 2, 3, 4], np.int32), 3, 1, 3) == []
    assert ngram_proposer.propose(stream, 0, 1, 3) == []
    s = ngram_proposer.TokenStream([1, 2])
    assert s.sync([3] * 40, 2).tolist() == [1, 2] + [3] * 40
    assert s.sync([3] * 41, 2)[-1] == 3 and s.size == 43


def _propose_by_brute_force(stream, k, lo, hi):
    """The proposer's rule spelled out: longest n first, latest match with k tokens after it."""
    size = len(stream)
    for n in range(min(hi, size - 1), lo - 1, -1):
        hits = [i for i in range(size - n) if (stream[i : i + n] == stream[size - n :]).all()]
        if hits:
            full = [h for h in hits if h + n + k <= size]
            start = (full[-1] if full else hits[-1]) + n
            return stream[start : start + k].tolist()
    return []


def test_ngram_proposer_equals_brute_force_on_random_streams():
    rng = np.random.RandomState(5)
    for _ in range(2000):
        stream = rng.randint(0, rng.randint(2, 6), rng.randint(1, 40)).astype(np.int32)
        k, lo = int(rng.randint(1, 5)), int(rng.randint(1, 4))
        hi = lo + int(rng.randint(0, 3))
        want = _propose_by_brute_force(stream, k, lo, hi)
        assert ngram_proposer.propose(stream, k, lo, hi) == want, (stream.tolist(), k, lo, hi)
