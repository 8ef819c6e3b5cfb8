"""JAX's TPU ragged paged attention behind the engine: what a CPU can check.

The kernel itself does not run off TPU (nor in TPU interpret mode, jax 0.10.2 / 0.12), so:

* the **adapter** (engine rows + the pool in the kernel's layout -> the kernel's arguments) is
  run through JAX's own ``ref_ragged_paged_attention`` and compared with jbatch's reference;
* the **lowering** of the engine's whole step with the kernel, for TPU, must succeed on CPU
  (Mosaic lowering runs in Python; ``tpu_lowering_context`` names a TPU chip for it).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from pallas_kernels import paged_attention_reference, resolve_impl
from pallas_kernels.tpu_attention import tpu_lowering_context, tpu_paged_attention_rows
from pallas_kernels.tpu_layout import TpuPoolLayout, interleave, split


def make_rows(rng, *, decode, blocks, block_q, h, kvh, d, page_size, max_pages, dtype):
    """An engine flat batch: ``decode`` context lengths (one row each; 0 = a padding row), then
    ``blocks`` of ``block_q`` rows as (context length, valid rows; 0 = padding). Every entry is
    its own sequence in a NaN-filled pool, through a permuted page table whose unused entries
    point at foreign pages or past the pool (``num_pages``, as the engine's unassigned ones)."""
    entries = [(n, 1 if n else 0, 1) for n in decode] + [(n, v, block_q) for n, v in blocks]
    e = len(entries)
    num_pages = e * max_pages + 2
    tables = rng.permutation(num_pages)[: e * max_pages].reshape(e, max_pages).astype(np.int32)
    k = np.full((num_pages, page_size, kvh, d), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    row_entry, positions = [], []
    for i, (n, valid, rows) in enumerate(entries):
        idx = np.arange(n)
        k[tables[i, idx // page_size], idx % page_size] = rng.randn(n, kvh, d)
        v[tables[i, idx // page_size], idx % page_size] = rng.randn(n, kvh, d)
        used = -(-n // page_size)
        tables[i, used:] = rng.choice([num_pages, *rng.randint(0, num_pages, 3)], max_pages - used)
        row_entry += [i] * rows
        positions += list(range(n - valid, n)) + [-1] * (rows - valid)
    t = len(positions)
    q = rng.randn(t, h, d)
    cast = lambda x: jnp.asarray(x, dtype)
    return dict(
        q=cast(q),
        k=cast(k),
        v=cast(v),
        row_entry=jnp.asarray(row_entry, jnp.int32),
        tables=jnp.asarray(tables),
        positions=jnp.asarray(positions, jnp.int32),
    )


def jax_reference(t):
    """JAX's reference kernel (eager: it loops over ``num_seqs``), its output padded to T rows."""

    def run(q, *args, **kw):
        out = ref_ragged_paged_attention(q, *args, **kw)
        return jnp.pad(out, ((0, t - out.shape[0]), (0, 0), (0, 0)))

    return run


CASES = {
    "decode_gqa3_pads_heads_and_dim": dict(
        decode=[5, 0, 33], blocks=[], h=9, kvh=3, d=64, page_size=16
    ),
    "prompt_chunks_page32": dict(
        decode=[], blocks=[(40, 5), (0, 0), (70, 8)], h=4, kvh=2, d=128, page_size=32
    ),
    "mixed_bf16_gqa3": dict(
        decode=[60, 2], blocks=[(8, 3)], h=9, kvh=3, d=64, page_size=16,
        dtype=jnp.bfloat16,
    ),
    "sliding_window_mha": dict(
        decode=[30], blocks=[(50, 8)], h=4, kvh=4, d=128, page_size=16,
        kw=dict(sliding_window=11),
    ),
    "soft_cap_mqa_bf16": dict(
        decode=[40], blocks=[(16, 6)], h=8, kvh=1, d=64, page_size=32,
        dtype=jnp.bfloat16, kw=dict(soft_cap=2.0, scale=0.2),
    ),
    "kv_heads_5_pad_to_8_mixed_lengths": dict(
        decode=[1, 63], blocks=[(64, 8), (9, 1)], h=10, kvh=5, d=32, page_size=16,
    ),
}  # fmt: skip


ON_TPU = jax.default_backend() == "tpu"


@pytest.mark.parametrize("kernel", ["jax_reference", "native"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_adapter_through_jax_reference_matches_jbatch(name, kernel):
    """``jax_reference``: the adapter's arguments through JAX's reference (any backend);
    ``native``: through the kernel itself, jitted (TPU only: scripts/tpu_check.sh)."""
    if kernel == "native" and not ON_TPU:
        pytest.skip("JAX's TPU kernel runs only on a TPU (not in interpret mode on CPU)")
    case = dict(CASES[name])
    kw, dtype = case.pop("kw", {}), case.pop("dtype", jnp.float32)
    x = make_rows(np.random.RandomState(len(name)), block_q=8, max_pages=4, dtype=dtype, **case)
    layout = TpuPoolLayout.of(case["kvh"], case["d"], dtype)
    kv = interleave(x["k"], x["v"], layout)  # the pool as the engine stores it on TPU
    rows = (x["q"], kv, x["row_entry"], x["tables"], x["positions"])
    if kernel == "native":
        run = lambda *a: tpu_paged_attention_rows(*a, layout, **kw)
        got = jax.jit(run)(*rows)
    else:
        got = tpu_paged_attention_rows(*rows, layout, kernel=jax_reference(rows[0].shape[0]), **kw)
    want = jax.jit(paged_attention_reference, static_argnames=tuple(kw))(
        x["q"][:, None], x["k"], x["v"], x["tables"][x["row_entry"]], x["positions"][:, None],
        **kw,
    )[:, 0]  # fmt: skip
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), "NaN from unused pages leaked into the result"
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    assert (got[np.asarray(x["positions"]) < 0] == 0).all(), "padding rows must be zero"


def test_layout_pads_to_what_the_kernel_tiles():
    lay = TpuPoolLayout.of(3, 64, jnp.bfloat16)
    assert (lay.kv_heads_padded, lay.head_dim_padded, lay.combined_heads) == (4, 128, 8)
    assert lay.padding_factor == pytest.approx(4 * 128 / (3 * 64))
    assert TpuPoolLayout.of(2, 128, jnp.float32).padding_factor == 1.0
    assert TpuPoolLayout.of(12, 128, jnp.bfloat16).kv_heads_padded == 16
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        TpuPoolLayout.of(0, 64, jnp.float32)


def test_tpu_layout_write_reads_back_like_the_compact_pool():
    """write_layer into the TPU layout, read through KVCache.pages, equals the compact pool."""
    from jbatch.models.config import ModelConfig
    from jbatch.models.kv_cache import KVCache, write_layer

    cfg = ModelConfig.from_hf_dict(SMOL | dict(num_hidden_layers=2))
    rng = np.random.RandomState(0)
    k_new, v_new = (jnp.asarray(rng.randn(5, 3, 64), jnp.float32) for _ in range(2))
    pages, offsets = jnp.array([0, 0, 3, 7, 8]), jnp.array([0, 15, 2, 9, 0])  # 8: dropped
    caches = [KVCache.full(cfg, 8, 16, jnp.float32, jnp.nan, tpu_layout=t) for t in (0, 1)]
    compact, tpu = (write_layer(c, 1, k_new, v_new, pages, offsets) for c in caches)
    assert tpu.k[1].shape == (8, 16, 8, 128) and tpu.v == ()
    for a, b in zip(compact.pages(1), tpu.pages(1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # NaN where unwritten
    np.testing.assert_array_equal(np.asarray(tpu.tpu_pool(1)[0]), np.asarray(tpu.k[1]))
    kv, lay = compact.tpu_pool(1)  # converting a compact pool gives the same array
    np.testing.assert_array_equal(np.asarray(kv), np.asarray(tpu.k[1]))
    assert [x.shape for x in split(kv, lay)] == [(8, 16, 3, 64)] * 2


def test_auto_picks_the_tpu_kernel_on_tpu_only(monkeypatch):
    from jbatch.engine.config import EngineConfig

    assert resolve_impl("auto") != "tpu"  # CPU CI
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_impl("auto") == "tpu"
    int8 = jnp.zeros((2, 16, 2, 64), jnp.int8)
    assert resolve_impl("auto", jnp.zeros((1, 4, 64)), int8) == "xla"  # per-token scales
    with pytest.raises(ValueError, match="needs a float32/bfloat16 pool"):
        resolve_impl("tpu", jnp.zeros((1, 4, 64)), int8)
    assert EngineConfig(attn_impl="auto").tpu_kv_layout
    assert not EngineConfig(attn_impl="auto", kv_cache_dtype="int8").tpu_kv_layout
    with pytest.raises(ValueError, match="attn_impl='tpu' needs kv_cache_dtype='auto'"):
        EngineConfig(attn_impl="tpu", kv_cache_dtype="int8")


# --------------------------------------------------------------------------------- TPU lowering

SMOL = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
    tie_word_embeddings=True,
)  # fmt: skip


def abstract_params(cfg, dtype):
    """Per-layer abstract params (the layout the engine jits), as ShapeDtypeStructs."""
    from jbatch.param_layout import expected_param_shapes

    shapes = expected_param_shapes(cfg)
    sds = lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype))
    layers = tuple(
        {name: sds(s[1:]) for name, s in shapes["layers"].items()} for _ in range(cfg.num_layers)
    )
    top = {k: sds(s) for k, s in shapes.items() if k != "layers"}
    return {**top, "layers": layers}


def lower_engine_step(model_cfg, dtype, rows, decode_rows):
    from jbatch.engine.config import EngineConfig
    from jbatch.engine.engine_core import EngineCore
    from jbatch.engine.state import init_state

    cfg = EngineConfig(
        max_slots=8, num_pages=64, page_size=16, max_seq_len=512, max_num_batched_tokens=64,
        dtype=dtype, attn_impl="tpu",
    )  # fmt: skip
    core = EngineCore(model_cfg, cfg)
    assert (rows, decode_rows) in core.layouts
    state = jax.eval_shape(lambda: init_state(model_cfg, cfg))
    assert state.cache.tpu is not None and state.cache.k[0].dtype == jnp.dtype(dtype)
    with tpu_lowering_context():
        lowered = core.lower_step(
            abstract_params(model_cfg, dtype), state, rows, decode_rows, ("tpu",)
        )
    return lowered.as_text()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket", [(0, 8), (16, 8)], ids=["decode", "mixed"])
@pytest.mark.parametrize("model", ["demo", "smollm2"])
def test_engine_step_lowers_for_tpu_with_one_kernel_per_layer(model, bucket, dtype):
    from jbatch.demo import demo_model_path
    from jbatch.models.config import ModelConfig

    if model == "demo":
        model_cfg = ModelConfig.from_file(demo_model_path() / "config.json")
    else:
        model_cfg = ModelConfig.from_hf_dict(SMOL)  # 30 layers: ~1-3 s to lower
    text = lower_engine_step(model_cfg, dtype, *bucket)
    # One Mosaic kernel (a tpu_custom_call in JAX's jitted wrapper), called once per layer.
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1
    assert len(re.findall(r"call @ragged_paged_attention\b", text)) == model_cfg.num_layers
    assert "ragged_paged_attention_kernel" in text
