"""The paged forward pass against HF transformers (float32, random weights)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jbatch.checkpoint import load_model
from jbatch.models.kv_cache import KVCache
from jbatch.models.llama import compute_logits, forward
from tests.hf_models import VARIANTS

NUM_PAGES = 96
BLOCK_Q = 8


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))[None]).logits[0].float().numpy()


def nan_cache(cfg, page_size) -> KVCache:
    """A pool whose every page starts as NaN: any read of an unwritten entry poisons the result."""
    return KVCache.full(cfg, NUM_PAGES, page_size, jnp.float32, jnp.nan)


def scrambled_tables(num_slots, max_pages, seed) -> np.ndarray:
    """Disjoint, randomly permuted page lists per slot."""
    perm = np.random.RandomState(seed).permutation(NUM_PAGES)
    return perm[: num_slots * max_pages].reshape(num_slots, max_pages).astype(np.int32)


@functools.partial(jax.jit, static_argnums=(0, 1, 8, 9), donate_argnums=3)
def _jitted_forward(
    cfg, impl, params, cache, tokens, positions, slots, tables, num_decode, packed_rows=None
):
    h, cache = forward(
        params,
        cfg,
        cache,
        tokens,
        positions,
        slots,
        tables,
        num_decode=num_decode,
        block_q=BLOCK_Q,
        attn_impl=impl,
        packed_rows=packed_rows,
    )
    return compute_logits(params, h, cfg), cache


class PagedRunner:
    """Feeds token rows through ``forward`` the way the engine does: decode rows first, then
    prompt chunks padded to blocks of BLOCK_Q."""

    def __init__(
        self,
        cfg,
        params,
        page_size,
        tables,
        impl="auto",
        decode_rows=2,
        prefill_rows=48,
        packed_rows=None,
    ):
        # Fixed row counts (padded with position -1) so each test compiles one program.
        # ``packed_rows``: the layers compute the prompt tokens packed into that many rows.
        self.decode_rows, self.prefill_rows = decode_rows, prefill_rows
        self.packed_rows = packed_rows
        self.cfg, self.params = cfg, params
        self.cache = nan_cache(cfg, page_size)
        self.tables = jnp.asarray(tables)
        self.impl = impl

    def _fwd(self, *args):
        return _jitted_forward(self.cfg, self.impl, *args)

    def step(self, decodes, chunks):
        """decodes: [(slot, token, pos)]; chunks: [(slot, tokens, start_pos)].
        Returns logits rows: one per decode, then one list per chunk."""
        toks, pos, slots = [], [], []
        for s, t, p in decodes:
            toks.append(t), pos.append(p), slots.append(s)
        pad = self.decode_rows - len(decodes)
        toks, pos, slots = toks + [0] * pad, pos + [-1] * pad, slots + [0] * pad
        spans = []
        for s, ids, start in chunks:
            spans.append(len(toks) - self.decode_rows)
            n = len(ids)
            pad = -n % BLOCK_Q
            toks += list(ids) + [0] * pad
            pos += list(range(start, start + n)) + [-1] * pad
            slots += [s] * (n + pad)
        pad = self.decode_rows + self.prefill_rows - len(toks)
        assert pad >= 0, "step does not fit the runner's fixed rows"
        toks, pos, slots = toks + [0] * pad, pos + [-1] * pad, slots + [0] * pad
        arr = lambda x: jnp.asarray(np.asarray(x, np.int32))
        assert self.packed_rows is None or sum(len(c[1]) for c in chunks) <= self.packed_rows
        logits, self.cache = self._fwd(
            self.params,
            self.cache,
            arr(toks),
            arr(pos),
            arr(slots),
            self.tables,
            self.decode_rows,
            self.packed_rows,
        )
        logits = np.asarray(logits)
        nd = self.decode_rows
        out = [logits[i] for i in range(len(decodes))]
        for (_, ids, _), off in zip(chunks, spans):
            out.append(logits[nd + off : nd + off + len(ids)])
        return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, hf_checkpoint):
    path, model = hf_checkpoint(request.param)
    cfg, params = load_model(path, dtype="float32")
    return request.param, cfg, params, model


@pytest.mark.parametrize("page_size", [4, 16])
def test_prefill_logits_match_hf(variant, page_size):
    name, cfg, params, model = variant
    tables = scrambled_tables(2, NUM_PAGES // 2, seed=page_size)
    rng = np.random.RandomState(7)
    for length in (1, 9, 40):
        ids = rng.randint(0, cfg.vocab_size, length)
        runner = PagedRunner(cfg, params, page_size, tables)
        (got,) = runner.step([], [(1, ids, 0)])
        err = rel_err(got, hf_logits(model, ids))
        assert err < 1e-4, f"{name} len={length} page_size={page_size}: rel err {err}"


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_chunked_prefill_then_decode_match_hf(variant, impl):
    """Two sequences share every step: A is prefilled in uneven chunks while B decodes, then both
    decode token by token. Every logits row must equal HF's for that sequence."""
    name, cfg, params, model = variant
    rng = np.random.RandomState(3)
    a = rng.randint(0, cfg.vocab_size, 45)
    b = rng.randint(0, cfg.vocab_size, 30)
    ref_a, ref_b = hf_logits(model, a), hf_logits(model, b)
    runner = PagedRunner(cfg, params, 4, scrambled_tables(2, 24, seed=11), impl=impl)
    got_a, got_b = {}, {}
    (first_b,) = runner.step([], [(1, b[:20], 0)])
    for i in range(20):
        got_b[i] = first_b[i]
    a_pos, b_pos = 0, 20
    for size in (13, 3, 17):  # A's prompt chunks, while B decodes one token per step
        row_b, chunk = runner.step([(1, b[b_pos], b_pos)], [(0, a[a_pos : a_pos + size], a_pos)])
        got_b[b_pos] = row_b
        for j in range(size):
            got_a[a_pos + j] = chunk[j]
        a_pos, b_pos = a_pos + size, b_pos + 1
    while a_pos < len(a):
        decodes = [(0, a[a_pos], a_pos)] + ([(1, b[b_pos], b_pos)] if b_pos < len(b) else [])
        rows = runner.step(decodes, [])
        got_a[a_pos] = rows[0]
        if b_pos < len(b):
            got_b[b_pos] = rows[1]
        a_pos, b_pos = a_pos + 1, b_pos + 1
    ga = np.stack([got_a[i] for i in range(len(a))])
    gb = np.stack([got_b[i] for i in range(len(b))])
    assert rel_err(ga, ref_a) < 1e-4, name
    assert rel_err(gb, ref_b) < 1e-4, name
    # Teacher-forced greedy: our argmax is HF's argmax, up to near-ties.
    for got, ref in ((ga, ref_a), (gb, ref_b)):
        chosen = got.argmax(-1)
        gap = ref.max(-1) - ref[np.arange(len(ref)), chosen]
        assert np.all(gap < 1e-3), name
    assert np.isfinite(np.asarray(runner.cache.k[0][runner.tables[0, 0]])).all()


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_packed_prompt_rows_match_hf(variant, impl):
    """Three prompts of 5, 11 and 19 tokens (48 block rows, 35 tokens) in one step beside a
    decode, the layers computing them packed into 40 rows (``forward(packed_rows=...)``),
    then decodes of all four: every logits row is HF's."""
    name, cfg, params, model = variant
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, cfg.vocab_size, n) for n in (20, 5, 11, 19)]
    refs = [hf_logits(model, ids) for ids in prompts]
    tables = scrambled_tables(4, 12, seed=13)
    runner = PagedRunner(cfg, params, 4, tables, impl=impl, decode_rows=4, packed_rows=40)
    got = [dict() for _ in prompts]
    (first,) = runner.step([], [(0, prompts[0][:16], 0)])  # 16 tokens: no packing needed
    got[0].update(enumerate(first))
    rows = runner.step([(0, prompts[0][16], 16)], [(i, prompts[i], 0) for i in (1, 2, 3)])
    got[0][16] = rows[0]
    for i, chunk in zip((1, 2, 3), rows[1:]):
        got[i].update(enumerate(chunk))
    pos = [17, 5, 11, 19]
    for _ in range(3):
        live = [i for i in range(4) if pos[i] < len(prompts[i])]
        out = runner.step([(i, prompts[i][pos[i]], pos[i]) for i in live], [])
        for i, row in zip(live, out):
            got[i][pos[i]] = row
            pos[i] += 1
    for i, ref in enumerate(refs):
        mine = np.stack([got[i][j] for j in sorted(got[i])])
        assert sorted(got[i]) == list(range(len(mine))), (name, i)
        err = rel_err(mine, ref[: len(mine)])
        assert err < 1e-4, f"{name} prompt {i}: rel err {err}"
    for i, n in enumerate(pos):  # each prompt's full pages hold its K, nothing NaN
        assert np.isfinite(np.asarray(runner.cache.k[0])[tables[i, : n // 4]]).all(), (name, i)


def test_bfloat16_forward_runs_close(hf_checkpoint):
    path, model = hf_checkpoint("llama")
    cfg, params = load_model(path, dtype="bfloat16")
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, 16)
    runner = PagedRunner(cfg, params, 16, scrambled_tables(1, 8, 0))
    runner.cache = KVCache.zeros(cfg, NUM_PAGES, 16, jnp.bfloat16)
    (got,) = runner.step([], [(0, ids, 0)])
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert rel_err(got, hf_logits(model, ids)) < 5e-2


def test_gemma3_multimodal_folder_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (text config nested, weights under
    ``language_model.``, a vision tower beside them): jbatch loads the language model, and its
    text-only logits are HF's."""
    import transformers

    from tests.hf_models import _BASE

    text = transformers.Gemma3TextConfig(**{**_BASE, **VARIANTS["gemma3"][2]})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    cfg = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=383, boi_token_index=381, eoi_token_index=382,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(tmp_path)
    jcfg, params = load_model(tmp_path)
    assert (jcfg.model_type, jcfg.num_layers) == ("gemma3", 3)
    ids = np.random.RandomState(1).randint(0, 380, 30)
    (got,) = PagedRunner(jcfg, params, 4, scrambled_tables(2, 48, seed=2)).step([], [(1, ids, 0)])
    assert rel_err(got, hf_logits(model, ids)) < 1e-4


def test_gemma2_through_the_pallas_kernel_matches_hf(hf_checkpoint):
    """The kernel gets Gemma 2's softmax scale and soft cap from the model (interpret mode)."""
    path, model = hf_checkpoint("gemma2")
    cfg, params = load_model(path, dtype="float32")
    ids = np.random.RandomState(4).randint(0, cfg.vocab_size, 19)
    runner = PagedRunner(cfg, params, 16, scrambled_tables(2, 8, seed=5), impl="pallas_interpret")
    (got,) = runner.step([], [(1, ids, 0)])
    assert rel_err(got, hf_logits(model, ids)) < 1e-4
