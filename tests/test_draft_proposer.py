"""The draft-model proposer (jbatch/engine/draft_proposer.py) on a tiny random HF checkpoint."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jbatch.engine.config import EngineConfig
from jbatch.engine.draft_proposer import draft_forward, load_draft, propose
from jbatch.engine.sampler import SlotSampling
from jbatch.models.config import ModelConfig
from jbatch.models.kv_cache import KVCache
from jbatch.tiny_model import write_tokenizer
from jbatch.tokenizer import Tokenizer

K, PAGE, NUM_PAGES, MAX_PAGES, SLOTS, BLOCK_Q = 4, 8, 32, 4, 4, 4
PROMPT_LENS = {0: 7, 2: 12, 3: 5}  # slot -> prompt length; slot 1 is a padding group
GROUP_SLOTS = np.array([2, 1, 0, 3], np.int32)

_forward = jax.jit(
    draft_forward, static_argnames=("draft_cfg", "num_decode", "block_q", "attn_impl")
)
_propose = jax.jit(propose, static_argnames=("draft_cfg", "num_tokens", "block_q", "attn_impl"))


def engine_cfg() -> EngineConfig:
    return EngineConfig(
        max_slots=SLOTS, page_size=PAGE, num_pages=NUM_PAGES, max_seq_len=PAGE * MAX_PAGES,
        dtype="float32", block_q=BLOCK_Q, attn_impl="xla",
    )  # fmt: skip


def block_rows(seqs: dict[int, list[int]]):
    """Prompt-chunk rows (positions from 0) in blocks of BLOCK_Q, one sequence per block."""
    tokens, positions, slots = [], [], []
    for slot, ids in seqs.items():
        n = -(-len(ids) // BLOCK_Q) * BLOCK_Q
        tokens += list(ids) + [0] * (n - len(ids))
        positions += list(range(len(ids))) + [-1] * (n - len(ids))
        slots += [slot] * n
    return tuple(jnp.asarray(np.array(a, np.int32)) for a in (tokens, positions, slots))


def prefill(draft, cache, tables, seqs):
    tokens, positions, slots = block_rows(seqs)
    return _forward(
        draft.params, draft.cfg, cache, tokens, positions, slots, tables,
        num_decode=0, block_q=BLOCK_Q, attn_impl="xla",
    )  # fmt: skip


def group_sampling(**rows) -> SlotSampling:
    """Per-group sampling: neutral (greedy) except the given per-group fields."""
    sp = SlotSampling.neutral(len(GROUP_SLOTS))
    return sp.replace(**{k: jnp.asarray(v, getattr(sp, k).dtype) for k, v in rows.items()})


def make_pair(hf_checkpoint, variant: str):
    """(path, torch model, loaded draft, prompts per slot, page tables) for ``variant``."""
    path, model = hf_checkpoint(variant)
    draft = load_draft(path, ModelConfig.from_file(path / "config.json"), engine_cfg())
    rng = np.random.RandomState(0)
    prompts = {s: rng.randint(3, draft.cfg.vocab_size, n).tolist() for s, n in PROMPT_LENS.items()}
    perm = rng.permutation(NUM_PAGES)[: SLOTS * MAX_PAGES].reshape(SLOTS, MAX_PAGES)
    tables = jnp.asarray(perm.astype(np.int32))
    return path, model, draft, prompts, tables


@pytest.fixture(scope="module")
def pair(hf_checkpoint):
    return make_pair(hf_checkpoint, "llama")


def run_propose(pair, sampling, step_index=None, num_drafts=None):
    """Prefill every prompt but its last token into a NaN pool, then propose from it."""
    _, _, draft, prompts, tables = pair
    cache = KVCache.full(draft.cfg, NUM_PAGES, PAGE, jnp.float32, jnp.nan)
    cache = prefill(draft, cache, tables, {s: p[:-1] for s, p in prompts.items()})
    last = [prompts[s][-1] if s in prompts else 0 for s in GROUP_SLOTS]
    pos = [PROMPT_LENS[s] - 1 if s in prompts else -1 for s in GROUP_SLOTS]
    steps = np.zeros(len(GROUP_SLOTS), np.int32) if step_index is None else step_index
    nd = None if num_drafts is None else jnp.asarray(num_drafts, jnp.int32)
    cache, drafts, probs = _propose(
        draft.params, draft.cfg, cache, jnp.asarray(last, jnp.int32), jnp.asarray(pos, jnp.int32),
        jnp.asarray(GROUP_SLOTS), tables, sampling, jnp.asarray(steps),
        nd, num_tokens=K, block_q=BLOCK_Q, attn_impl="xla",
    )  # fmt: skip
    return cache, np.asarray(drafts), np.asarray(probs)


@pytest.fixture(scope="module")
def greedy(pair):
    return run_propose(pair, group_sampling())


def assert_hf_continuation(pair, greedy) -> None:
    _, model, _, prompts, _ = pair
    _, drafts, probs = greedy
    for g, slot in enumerate(GROUP_SLOTS):
        if slot not in prompts:
            continue
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompts[slot]]), max_new_tokens=K, do_sample=False, pad_token_id=0
            )
        assert drafts[g].tolist() == out[0, len(prompts[slot]) :].tolist(), f"group {g}"
        np.testing.assert_array_equal(probs[g], np.eye(probs.shape[-1])[drafts[g]])  # one-hot


def test_greedy_proposals_are_the_drafts_own_continuation(pair, greedy):
    assert_hf_continuation(pair, greedy)


def test_greedy_proposals_of_gemma2(hf_checkpoint):
    """Soft caps, sandwich norms, and a sliding window shorter than the prompts (the other
    families differ only inside ``llama.forward``, which the fidelity tests cover)."""
    pair = make_pair(hf_checkpoint, "gemma2")
    assert_hf_continuation(pair, run_propose(pair, group_sampling()))


def pool_entries(cache: KVCache, tables, slot: int, n: int) -> np.ndarray:
    """[layers, 2, n, KVH, D]: the K/V of a slot's first ``n`` positions, read via its table."""
    pos = np.arange(n)
    pages, offs = np.asarray(tables)[slot, pos // PAGE], pos % PAGE
    return np.stack([np.stack([np.asarray(k)[pages, offs], np.asarray(v)[pages, offs]])
                     for k, v in zip(cache.k, cache.v)])  # fmt: skip


def assert_pool(pair, cache, drafts, num_drafts) -> None:
    """The pool holds a fresh prefill's K/V of each prompt and its first ``num_drafts[g]``
    drafts (``d_K`` included when all K are offered), and NaN everywhere else."""
    _, _, draft, prompts, tables = pair
    seqs = {}
    for g, slot in enumerate(GROUP_SLOTS):
        if slot in prompts:
            seqs[int(slot)] = prompts[slot] + drafts[g, : num_drafts[g]].tolist()
    fresh = prefill(draft, KVCache.full(draft.cfg, NUM_PAGES, PAGE, jnp.float32, jnp.nan),
                    tables, seqs)  # fmt: skip
    written = np.zeros((NUM_PAGES, PAGE), bool)
    for slot, ids in seqs.items():
        got, want = (
            pool_entries(cache, tables, slot, len(ids)),
            pool_entries(fresh, tables, slot, len(ids)),
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        pos = np.arange(len(ids))
        written[np.asarray(tables)[slot, pos // PAGE], pos % PAGE] = True
    for layer in (*cache.k, *cache.v):  # nothing else was written: padding group included
        assert np.isnan(np.asarray(layer)[~written]).all()
        assert np.isfinite(np.asarray(layer)[written]).all()


def test_draft_pool_equals_a_fresh_prefill_and_padding_writes_nothing(pair, greedy):
    cache, drafts, probs = greedy
    assert np.isfinite(probs).all() and (drafts >= 0).all()
    assert_pool(pair, cache, drafts, [K] * len(GROUP_SLOTS))


def test_rows_past_num_drafts_are_not_written(pair, greedy):
    """Only the rows the target verifies (past them a page-table entry may be stale)."""
    num_drafts = [1, K, 0, 2]  # group 1 is padding whatever it says
    cache, drafts, probs = run_propose(pair, group_sampling(), num_drafts=num_drafts)
    for g, n in enumerate(num_drafts):
        if GROUP_SLOTS[g] != 1:
            np.testing.assert_array_equal(drafts[g, :n], greedy[1][g, :n])
        assert (drafts[g, n:] == 0).all() and (probs[g, n:] == 0).all()
    assert_pool(pair, cache, drafts, num_drafts)


SAMPLED = dict(
    temperature=[0.8, 0.9, 0.0, 1.0],
    top_k=[0, 0, 0, 20],
    top_p=[0.9, 1.0, 1.0, 1.0],
    min_p=[0.0, 0.0, 0.0, 0.05],
    seed=[11, 12, 13, 14],
)


def test_sampled_proposals_are_seeded_and_q_is_a_distribution(pair, greedy):
    _, a, qa = run_propose(pair, group_sampling(**SAMPLED))
    _, b, qb = run_propose(pair, group_sampling(**SAMPLED))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(qa, qb)
    reseeded = group_sampling(**{**SAMPLED, "seed": [21, 22, 23, 24]})
    _, c, _ = run_propose(pair, reseeded)
    assert (a[[0, 3]] != c[[0, 3]]).any(), "another seed drew the same drafts"
    _, d, _ = run_propose(pair, group_sampling(**SAMPLED), np.full(len(GROUP_SLOTS), 5, np.int32))
    assert (a[[0, 3]] != d[[0, 3]]).any(), "another RNG counter drew the same drafts"

    np.testing.assert_array_equal(a[2], greedy[1][2])  # the greedy group: argmax, one-hot q
    np.testing.assert_array_equal(qa[2], np.eye(qa.shape[-1])[a[2]])
    assert (qa[1] == 0).all() and (a[1] == 0).all()  # padding group
    for g in (0, 2, 3):
        np.testing.assert_allclose(qa[g].sum(-1), 1.0, rtol=1e-5)
        assert (qa[g][np.arange(K), a[g]] > 0).all(), "a draft outside its own q"
    kept = qa[3] > 0  # [K, V]
    assert (kept.sum(-1) <= 20).all()  # top-k 20
    floor = 0.05 * qa[3].max(-1, keepdims=True) * (1 - 1e-5)  # min-p 0.05
    assert (np.where(kept, qa[3], 1.0) >= floor).all()


def test_draft_must_share_the_vocabulary(pair, tmp_path):
    path, _, draft, _, _ = pair
    wrong = tmp_path / "wrong_vocab"
    shutil.copytree(path, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "vocab_size": 512}))
    with pytest.raises(ValueError, match="vocab_size=512.*vocab_size=384"):
        load_draft(wrong, draft.cfg, engine_cfg())

    other_tok = tmp_path / "other_tokenizer"
    shutil.copytree(path, other_tok)
    write_tokenizer(other_tok, draft.cfg.vocab_size, ["an entirely different corpus " * 50])
    with pytest.raises(ValueError, match="tokenizer"):
        load_draft(other_tok, draft.cfg, engine_cfg(), Tokenizer.from_dir(path))
    load_draft(path, draft.cfg, engine_cfg(), Tokenizer.from_dir(path))  # the same one loads


def test_draft_draws_use_stream_2_of_the_requests_counter(pair):
    """Draw i of a group is the inverse CDF of its q at the uniform of
    fold_in(fold_in(key(seed), step_index + i), 2)."""
    steps = np.array([3, 0, 0, 9], np.int32)
    _, drafts, q = run_propose(pair, group_sampling(**SAMPLED), steps)
    for g in (0, 3):
        for i in range(K):
            key = jax.random.fold_in(jax.random.key(SAMPLED["seed"][g]), steps[g] + i)
            u = float(jax.random.uniform(jax.random.fold_in(key, 2)))
            cdf = np.cumsum(q[g, i], dtype=np.float64)
            assert drafts[g, i] == min(
                np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1
            )
