"""Device sampler: greedy, penalties, filters vs transformers, statistics, batch invariance."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jbatch.engine import sampler
from jbatch.engine.sampler import SlotSampling, sample

sample_jit = jax.jit(sample)


def make_sp(slots, **fields):
    sp = SlotSampling.neutral(slots)
    return sp.replace(**{k: jnp.asarray(v, getattr(sp, k).dtype) for k, v in fields.items()})


def call(logits, sp, step=None, prompt=None, counts=None, fn=sample_jit):
    logits = jnp.asarray(logits, jnp.float32)
    s, v = logits.shape
    step = jnp.zeros((s,), jnp.int32) if step is None else jnp.asarray(step, jnp.int32)
    prompt = jnp.zeros((s, v), bool) if prompt is None else jnp.asarray(prompt, bool)
    counts = jnp.zeros((s, v), jnp.int32) if counts is None else jnp.asarray(counts, jnp.int32)
    tok, lp = fn(logits, sp, step, prompt, counts)
    return np.asarray(tok), np.asarray(lp)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_greedy_is_argmax_and_logprob_is_raw():
    logits = np.random.default_rng(0).normal(size=(6, 300)).astype(np.float32) * 4
    tok, lp = call(logits, SlotSampling.neutral(6))
    np.testing.assert_array_equal(tok, logits.argmax(-1))
    np.testing.assert_allclose(lp, log_softmax(logits)[np.arange(6), tok], atol=1e-5)


def test_penalties_match_numpy_and_transformers():
    rng = np.random.default_rng(1)
    s, v = 5, 64
    x = rng.normal(size=(s, v)).astype(np.float32) * 3
    prompt = rng.random((s, v)) < 0.2
    counts = rng.integers(0, 4, size=(s, v)) * (rng.random((s, v)) < 0.3)
    rep = np.array([1.0, 1.3, 0.7, 2.0, 1.1], np.float32)
    pres = np.array([0.0, 0.5, -1.0, 2.0, 0.3], np.float32)
    freq = np.array([0.0, 0.2, 0.4, -0.5, 1.5], np.float32)
    sp = make_sp(s, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    got = np.asarray(
        sampler._apply_penalties(jnp.asarray(x), sp, jnp.asarray(prompt), jnp.asarray(counts))
    )
    seen = prompt | (counts > 0)
    r = rep[:, None]
    want = np.where(seen, np.where(x > 0, x / r, x * r), x)
    want = want - freq[:, None] * counts - pres[:, None] * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Repetition part alone == transformers' processor fed the prompt+output token ids.
    for i in range(s):
        ids = torch.tensor(np.nonzero(seen[i])[0])[None]
        hf = RepetitionPenaltyLogitsProcessor(float(rep[i]))(ids, torch.tensor(x[i : i + 1]))
        one = make_sp(1, repetition_penalty=rep[i : i + 1])
        ours = sampler._apply_penalties(
            jnp.asarray(x[i : i + 1]), one, jnp.asarray(seen[i : i + 1]), jnp.zeros((1, v), int)
        )
        np.testing.assert_allclose(np.asarray(ours), hf.numpy(), rtol=1e-6)
    # Greedy decoding follows the penalised logits.
    tok, _ = call(x, sp, prompt=prompt, counts=counts)
    np.testing.assert_array_equal(tok, want.argmax(-1))


def hf_support(row, temperature, top_k, top_p, min_p):
    scores = torch.tensor(row, dtype=torch.float32)[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return np.isfinite(scores[0].numpy())


def near_top_p_boundary(row, temperature, top_k, top_p, eps=1e-4):
    z = np.sort(np.asarray(row, np.float64) / temperature)[::-1]
    if top_k > 0:
        z = z[:top_k]
    p = np.exp(z - z[0])
    c = np.cumsum(p / p.sum())
    return top_p < 1.0 and np.min(np.abs(c - top_p)) < eps


@pytest.mark.parametrize("vocab", [50, 1000])  # 1000 > CANDIDATES: exercises the bisection path
def test_filters_match_transformers(vocab):
    rng = np.random.default_rng(vocab)
    rows, params = [], []
    while len(rows) < 24:
        row = (rng.normal(size=vocab) * rng.choice([0.3, 1.0, 4.0])).astype(np.float32)
        t = float(rng.choice([0.5, 1.0, 1.7]))
        k = int(rng.choice([0, 0, 1, 3, 40, 300, 700]))
        p = float(rng.choice([1.0, 0.95, 0.6, 0.2, 0.999]))
        m = float(rng.choice([0.0, 0.0, 0.05, 0.3]))
        if near_top_p_boundary(row, t, k, p):
            continue  # float32 cumulative sums may legitimately disagree exactly at the edge
        rows.append(row)
        params.append((t, k, p, m))
    t, k, p, m = (np.array(c) for c in zip(*params))
    sp = make_sp(len(rows), temperature=t, top_k=k, top_p=p, min_p=m)
    masked = sampler.filtered_logits(jnp.asarray(np.stack(rows)), sp, jnp.zeros(len(rows), bool))
    ours = np.isfinite(np.asarray(masked))
    for i, row in enumerate(rows):
        want = hf_support(row, *params[i])
        np.testing.assert_array_equal(ours[i], want, err_msg=f"row {i} params {params[i]}")


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 4, 1.0, 0.0), (1.0, 0, 1.0, 0.08)],
)
def test_empirical_distribution(temperature, top_k, top_p, min_p):
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    n = 20000
    sp = make_sp(
        n,
        temperature=np.full(n, temperature),
        top_k=np.full(n, top_k),
        top_p=np.full(n, top_p),
        min_p=np.full(n, min_p),
        seed=np.arange(n),
    )
    tok, _ = call(np.tile(logits, (n, 1)), sp, step=np.full(n, 3))
    keep = hf_support(logits, temperature, top_k, top_p, min_p)
    want = np.where(keep, np.exp(logits / temperature), 0.0)
    want /= want.sum()
    freq = np.bincount(tok, minlength=len(logits)) / n
    assert np.all(freq[~keep] == 0)
    assert np.max(np.abs(freq - want)) < 0.015, (freq, want)


def test_same_seed_step_same_token_and_steps_vary():
    v, n = 100, 400
    logits = np.zeros((n, v), np.float32)  # uniform: every step is a fresh draw
    sp = make_sp(n, temperature=np.ones(n), seed=np.full(n, 1234))
    a, _ = call(logits, sp, step=np.arange(n))
    b, _ = call(logits, sp, step=np.arange(n))
    np.testing.assert_array_equal(a, b)
    assert len(set(a.tolist())) > 80  # 400 draws over 100 tokens
    c, _ = call(logits, make_sp(n, temperature=np.ones(n), seed=np.full(n, 99)), np.arange(n))
    assert np.mean(a == c) < 0.1


@functools.cache
def _logits_pool(v):
    rng = np.random.default_rng(7)
    return (rng.normal(size=(32, v)) * rng.choice([0.2, 1.0, 5.0], size=(32, 1))).astype(np.float32)


row_params = st.tuples(
    st.sampled_from([0.0, 1e-4, 0.5, 1.0, 2.0]),  # temperature
    st.sampled_from([0, 1, 5, 200, 600]),  # top_k
    st.sampled_from([1.0, 0.9, 0.5, 0.999]),  # top_p
    st.sampled_from([0.0, 0.1]),  # min_p
    st.sampled_from([1.0, 1.3]),  # repetition_penalty
    st.sampled_from([0.0, 0.7]),  # presence_penalty
    st.integers(0, 2**32 - 1),  # seed
    st.integers(0, 10_000),  # step
    st.integers(0, 31),  # which logits row
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=row_params, others=st.lists(row_params, min_size=7, max_size=7), pos=st.integers(0, 7)
)
def test_batch_invariance(target, others, pos):
    v = 1000
    pool = _logits_pool(v)
    rows = [*others[:pos], target, *others[pos:]]

    def run(rs):
        t, k, p, m, r, pr, seed, step, li = (np.array(c) for c in zip(*rs))
        sp = make_sp(
            len(rs), temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r,
            presence_penalty=pr, seed=seed,
        )  # fmt: skip
        counts = (np.arange(v)[None] % (li[:, None] + 3) == 0).astype(np.int32)
        prompt = np.arange(v)[None] % (li[:, None] + 5) == 1
        return call(pool[li], sp, step=step, prompt=prompt, counts=counts)

    tok_alone, lp_alone = run([target])
    tok_batch, lp_batch = run(rows)
    assert tok_batch[pos] == tok_alone[0]
    assert lp_batch[pos] == lp_alone[0]


def test_no_recompilation_across_parameter_values():
    @jax.jit
    def fresh_sample(*args):  # own jit cache, independent of the other tests' shapes
        return sample(*args)

    fn = fresh_sample
    s, v = 4, 512
    rng = np.random.default_rng(3)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda rec: messages.append(rec.getMessage())
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            for i in range(12):
                sp = SlotSampling.neutral(s)
                for slot in range(s):
                    sp = sp.set_row(
                        slot,
                        temperature=float(rng.choice([0.0, 0.5, 1.0])),
                        top_k=int(rng.choice([0, 1, 10, 400])),
                        top_p=float(rng.choice([1.0, 0.3, 0.9])),
                        min_p=float(rng.choice([0.0, 0.2])),
                        repetition_penalty=float(rng.choice([1.0, 1.5])),
                        presence_penalty=float(rng.choice([0.0, -1.0])),
                        frequency_penalty=float(rng.choice([0.0, 0.5])),
                        seed=int(rng.integers(0, 2**32)),
                    )
                call(rng.normal(size=(s, v)), sp, step=np.full(s, i), fn=fn)
    finally:
        logger.removeHandler(handler)
    assert fn._cache_size() == 1
    compiles = [m for m in messages if m.startswith("Compiling jit(fresh_sample)")]
    assert len(compiles) == 1, compiles


def test_degenerate_logits_never_nan_or_out_of_range():
    v = 300
    logits = np.full((6, v), -np.inf, np.float32)
    logits[:5, 17] = 3.0  # one finite logit per row
    logits[5] = -np.inf  # completely masked row
    sp = make_sp(
        6,
        temperature=[1.0, 1e-4, 0.0, 2.0, 1.0, 1.0],
        top_k=[0, 0, 0, 5, 1, 3],
        top_p=[1.0, 1.0, 1.0, 0.5, 0.9, 0.5],
        min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.5],
        repetition_penalty=[1.0, 1.2, 1.0, 1.0, 1.0, 1.0],
    )
    tok, lp = call(logits, sp, step=np.arange(6))
    np.testing.assert_array_equal(tok[:5], 17)
    np.testing.assert_allclose(lp[:5], 0.0, atol=1e-6)
    assert 0 <= tok[5] < v and not np.isnan(lp).any()
    # Tiny temperature over ordinary logits: behaves like argmax, no NaN.
    x = np.random.default_rng(5).normal(size=(4, v)).astype(np.float32) * 10
    tok, lp = call(x, make_sp(4, temperature=np.full(4, 1e-4), seed=np.arange(4)))
    np.testing.assert_array_equal(tok, x.argmax(-1))
    assert np.isfinite(lp).all()


def test_bfloat16_logits_and_set_row():
    x = np.random.default_rng(6).normal(size=(3, 100)).astype(np.float32)
    sp = SlotSampling.neutral(3).set_row(1, temperature=0.8, seed=5)
    assert sp.temperature.dtype == jnp.float32 and sp.seed.dtype == jnp.uint32
    assert float(sp.temperature[1]) == pytest.approx(0.8) and int(sp.seed[1]) == 5
    tok, lp = call(jnp.asarray(x, jnp.bfloat16), sp)
    assert tok.dtype == np.int32 and lp.dtype == np.float32
    assert tok[0] == np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)).argmax(-1)[0]


def test_rows_read_the_penalty_statistics_of_their_slots():
    """The engine samples a step's rows, whose penalty statistics live per slot: ``rows`` maps
    each row to its slot, and the result is that of sampling the slots' own rows."""
    rng = np.random.default_rng(3)
    slots, vocab = 6, 300
    logits = jnp.asarray(rng.normal(size=(slots, vocab)), jnp.float32)
    prompt_mask = jnp.asarray(rng.random((slots, vocab)) < 0.2)
    counts = jnp.asarray(rng.integers(0, 3, (slots, vocab)), jnp.int32)
    sp = SlotSampling.neutral(slots).replace(
        temperature=jnp.asarray([0.0, 0.8, 0.0, 1.2, 0.5, 0.0], jnp.float32),
        repetition_penalty=jnp.asarray([1.3, 1.0, 1.1, 1.0, 1.5, 2.0], jnp.float32),
        frequency_penalty=jnp.asarray([0.0, 0.4, 0.0, 0.2, 0.0, 0.0], jnp.float32),
        seed=jnp.arange(slots, dtype=jnp.uint32),
    )
    step = jnp.asarray([0, 3, 1, 7, 2, 5], jnp.int32)
    want_tok, want_lp = sample(logits, sp, step, prompt_mask, counts)
    rows = jnp.asarray([4, 1, 5, 0], jnp.int32)  # a step's rows, in any order, some slots idle
    at = lambda a: a[rows]
    tok, lp = sample(at(logits), jax.tree.map(at, sp), at(step), prompt_mask, counts, rows=rows)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok)[rows])
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(want_lp)[rows])
