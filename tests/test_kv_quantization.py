"""The 8-bit KV pool (``kv_cache_dtype="int8"`` / ``"fp8_e4m3"``): the quantizer's error bound,
every attention path on a quantized pool (exactly the float path on the dequantized pool, close to
the float pool), capacity, and the engine's invariants with the quantized setting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jbatch import LLM, EngineConfig, SamplingParams
from jbatch.models.config import ModelConfig
from jbatch.models.kv_cache import KVCache, bytes_per_token, write_layer
from pallas_kernels import paged_attention, ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.kv_quant import SCALE_DTYPE, check_backend, dequantize, qmax, quantize
from tests.compile_counter import count_compiles
from tests.test_paged_attention import make_case
from tests.test_ragged_paged_attention import CPU_FAST_COMPILE, make_ragged

INT8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)


def quantized_pool(k_pool, v_pool, dtype=INT8):
    """A float pool (NaN in unused entries) as 8-bit data + scales; NaN rows get NaN scales."""
    (kq, ks), (vq, vs) = (quantize(jnp.asarray(p, jnp.float32), dtype) for p in (k_pool, v_pool))
    return kq, vq, ks, vs


# ---- the quantizer -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
def test_round_trip_error_bound(dtype):
    rng = np.random.RandomState(0)
    mags = 10.0 ** rng.uniform(-6, 4, (64, 4, 1))  # rows from 1e-6 to 1e4
    x = (rng.randn(64, 4, 32) * mags).astype(np.float32)
    x[3, 1] = 0.0  # an all-zero row
    data, scale = jax.jit(quantize, static_argnums=1)(jnp.asarray(x), dtype)
    assert data.dtype == dtype and scale.dtype == SCALE_DTYPE and scale.shape == (64, 4)
    s = np.asarray(scale, np.float32)
    amax = np.abs(x).max(-1)
    # The stored (rounded) scale is the one used, and covers the row: no entry is clipped.
    assert (s >= amax / qmax(dtype)).all() and (s <= amax / qmax(dtype) * 1.02).all()
    back = np.asarray(dequantize(data, scale))
    assert (back[3, 1] == 0).all() and s[3, 1] == 0
    err = np.abs(back - x)
    if dtype == INT8:  # half a step, plus the float32 product's rounding
        bound = 0.5 * s[..., None] * (1 + 1e-6)
    else:  # 3 mantissa bits: 2^-4 relative; subnormals (below 2^-6 x scale): 2^-10 x scale
        bound = 2.0**-4 * np.abs(x) + 2.0**-10 * s[..., None]
    assert (err <= bound).all(), float((err / bound).max())
    assert (err <= 0.5 * s[..., None]).any()  # not vacuous: errors are within a step, not zero


def test_pool_holds_at_least_175x_the_tokens_of_a_bf16_pool():
    cfg = ModelConfig("llama", 384, 256, 512, 2, 4, 2, 64)  # head_dim 64
    shape = lambda dtype: jax.eval_shape(lambda: KVCache.zeros(cfg, 32, 16, dtype))
    bf16, int8 = bytes_per_token(shape(jnp.bfloat16)), bytes_per_token(shape(INT8))
    assert int8 == 2 * 2 * 2 * (64 + 2)  # K and V, 2 layers, 2 KV heads, D bytes + a bf16 scale
    assert bf16 / int8 >= 1.75
    assert bf16 / int8 == pytest.approx(128 / 66)  # 1.94x


def test_write_layer_quantizes_rows_and_drops_padding():
    cfg = ModelConfig("llama", 384, 32, 64, 1, 2, 2, 16)
    cache = KVCache.full(cfg, 4, 4, INT8, jnp.nan)  # reads as NaN until written
    k = jnp.asarray(np.random.RandomState(1).randn(3, 2, 16), jnp.float32)
    pages, offsets = jnp.array([2, 0, 4]), jnp.array([1, 3, 0])  # page 4: out of bounds
    cache = write_layer(cache, 0, k, 2 * k, pages, offsets)
    kq = np.asarray(dequantize(cache.k[0], cache.k_scale[0]))
    vq = np.asarray(dequantize(cache.v[0], cache.v_scale[0]))
    np.testing.assert_allclose(kq[2, 1], k[0], atol=0.02)
    np.testing.assert_allclose(vq[0, 3], 2 * k[1], atol=0.04)
    assert np.isnan(kq[1]).all() and np.isnan(kq[2, 0]).all()  # untouched rows stay unwritten


# ---- every attention path ------------------------------------------------------------------------


def _block_args(case, window, seed):
    rng = np.random.RandomState(seed)
    q, kp, vp, tables, pos, _, _ = make_case(rng, **case)
    return jnp.asarray(q), kp, vp, jnp.asarray(tables), jnp.asarray(pos), window


BLOCK_CASES = {  # GQA, prompt blocks and decode rows, sliding window, several pages per chunk
    "gqa4_blocks_window": (
        dict(n=3, bq=4, h=8, kvh=2, d=16, page_size=4, num_pages=40, max_pages=6),
        5,
    ),
    "mha_decode": (dict(n=4, bq=1, h=2, kvh=2, d=32, page_size=8, num_pages=24, max_pages=4), None),
}


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_interpret"])
@pytest.mark.parametrize("name", sorted(BLOCK_CASES))
def test_block_paths_on_int8_pool(impl, name):
    """Permuted page tables, NaN in every unused entry (data NaN -> NaN scales), GQA, window."""
    case, window = BLOCK_CASES[name]
    q, kp, vp, tables, pos, window = _block_args(case, window, len(name))
    kq, vq, ks, vs = quantized_pool(kp, vp)
    deq_k, deq_v = dequantize(kq, ks), dequantize(vq, vs)
    fn = lambda q, k, v, *s: paged_attention(
        q,
        k,
        v,
        tables,
        pos,
        sliding_window=window,
        impl=impl,
        **dict(zip(("k_scales", "v_scales"), s)),
    )
    run = lambda *a: jax.jit(fn).lower(*a).compile(compiler_options=CPU_FAST_COMPILE)(*a)
    got = np.asarray(run(q, kq, vq, ks, vs))
    on_dequantized = np.asarray(run(q, deq_k, deq_v))
    on_float = np.asarray(run(q, jnp.asarray(kp), jnp.asarray(vp)))
    assert np.isfinite(got).all(), "NaN from unused pages leaked into the result"
    np.testing.assert_allclose(got, on_dequantized, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(got, on_float, atol=0.05)  # int8: ~1% of |v| per entry
    assert (got[np.asarray(pos) < 0] == 0).all()


def test_xla_path_on_fp8_pool():
    case, window = BLOCK_CASES["gqa4_blocks_window"]
    q, kp, vp, tables, pos, window = _block_args(case, window, 3)
    kq, vq, ks, vs = quantized_pool(kp, vp, FP8)
    kw = dict(sliding_window=window, impl="xla")
    got = np.asarray(paged_attention(q, kq, vq, tables, pos, k_scales=ks, v_scales=vs, **kw))
    same = paged_attention(q, dequantize(kq, ks), dequantize(vq, vs), tables, pos, **kw)
    np.testing.assert_allclose(got, np.asarray(same), atol=1e-6, rtol=1e-6)
    on_float = paged_attention(q, jnp.asarray(kp), jnp.asarray(vp), tables, pos, **kw)
    np.testing.assert_allclose(got, np.asarray(on_float), atol=0.15)  # fp8: 2^-4 relative


def test_ragged_kernel_on_int8_pool_with_splits_and_soft_cap():
    """The Pallas kernel (interpret mode) loads the scale blocks with the pages: mixed decode and
    prefill rows, GQA 4, KV splits, soft cap, rows outside every sequence."""
    q, kp, vp, tables, seq_lens, qs = make_ragged(
        np.random.RandomState(5), query_lens=[1, 6, 1, 3], h=8, kvh=2, d=16, page_size=4,
        max_pages=6, extra=2,
    )  # fmt: skip
    kq, vq, ks, vs = quantized_pool(kp, vp)
    kw = dict(soft_cap=3.0, sliding_window=9)
    fn = lambda q, k, v, s: ragged_paged_attention(
        q, k, v, tables, seq_lens, qs, num_kv_splits=2, interpret=True, k_scales=s[0],
        v_scales=s[1], **kw,
    )  # fmt: skip
    got = jax.jit(fn).lower(q, kq, vq, (ks, vs)).compile(compiler_options=CPU_FAST_COMPILE)
    got = np.asarray(got(q, kq, vq, (ks, vs)))
    want = ragged_paged_attention_reference(
        q, dequantize(kq, ks), dequantize(vq, vs), tables, seq_lens, qs, **kw
    )
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(want), atol=2e-5, rtol=2e-5)
    assert (got[int(qs[-1]) :] == 0).all()


def test_ragged_kernel_rejects_mismatched_scales():
    q = jnp.zeros((5, 4, 16), jnp.float32)
    kq = jnp.zeros((6, 8, 2, 16), INT8)
    args = (jnp.zeros((3, 2), jnp.int32), jnp.ones(3, jnp.int32), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"k_scales must be bfloat16 \(6, 8, 2\)"):
        bad = jnp.zeros((6, 8, 2), jnp.float32)
        ragged_paged_attention(q, kq, kq, *args, interpret=True, k_scales=bad, v_scales=bad)
    with pytest.raises(ValueError, match="int8 pool needs scales"):
        ragged_paged_attention(q, kq, kq, *args, interpret=True)


def test_kernel_lowers_for_cuda_with_an_int8_pool():
    """The quantized kernel lowers to one Triton call (Python-side lowering, no GPU needed)."""
    sd = jax.ShapeDtypeStruct
    pool, scales = sd((512, 16, 8, 128), INT8), sd((512, 16, 8), SCALE_DTYPE)
    idx = [sd((40, 64), jnp.int32), sd((40,), jnp.int32), sd((41,), jnp.int32)]
    fn = lambda q, k, v, ks, vs, *i: ragged_paged_attention(
        q, k, v, *i, max_query_len=16, k_scales=ks, v_scales=vs
    )
    try:
        exported = jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(sd((96, 32, 128), jnp.bfloat16), pool, pool, scales, scales, *idx)
    except (NotImplementedError, jax.errors.JaxRuntimeError) as e:  # pragma: no cover
        pytest.skip(f"this jax cannot lower Pallas for cuda off-GPU: {e}")
    module = exported.mlir_module()
    assert module.count("__gpu$xla.gpu.triton") == 1
    assert "ragged_paged_attention_m64_bk128_q8" in module


def test_model_forward_on_int8_pool_same_through_kernel_and_xla(hf_checkpoint):
    """``llama._attention`` hands the scales to the Pallas branch (one ragged call for decode
    rows and prompt blocks) as to the XLA one: same logits, on a NaN-initialised int8 pool."""
    from jbatch.checkpoint import load_model
    from jbatch.models.llama import compute_logits, forward

    cfg, params = load_model(hf_checkpoint("llama")[0], dtype="float32")
    tables = jnp.asarray(np.random.RandomState(0).permutation(16)[:12].reshape(2, 6), jnp.int32)
    ids = np.random.RandomState(1).randint(3, 384, 21)
    # 2 decode rows (slot 1 at position 0; padding), then slot 0's 21-token prompt in 3 blocks
    toks = jnp.asarray(np.concatenate([[ids[0], 0], ids, [0, 0, 0]]), jnp.int32)
    pos = jnp.asarray(np.concatenate([[0, -1], np.arange(21), [-1] * 3]), jnp.int32)
    slots = jnp.asarray(np.concatenate([[1, 0], np.zeros(24)]), jnp.int32)

    def run(impl):
        def step(cache):
            kw = dict(num_decode=2, block_q=8, attn_impl=impl)
            h, cache = forward(params, cfg, cache, toks, pos, slots, tables, **kw)
            return compute_logits(params, h, cfg), cache

        cache = KVCache.full(cfg, 16, 4, INT8, jnp.nan)
        fn = jax.jit(step).lower(cache).compile(compiler_options=CPU_FAST_COMPILE)
        return fn(cache)

    (xla, cache), (kernel, _) = run("xla"), run("pallas_interpret")
    valid = np.asarray(pos) >= 0
    assert np.isfinite(np.asarray(xla)[valid]).all() and cache.k[0].dtype == INT8
    np.testing.assert_allclose(np.asarray(kernel)[valid], np.asarray(xla)[valid], atol=1e-4)


# ---- the engine ----------------------------------------------------------------------------------


def test_kv_cache_dtype_is_validated_before_weights_load(tmp_path):
    with pytest.raises(ValueError, match="'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="'fp8'"):
        LLM(tmp_path / "no-such-model", kv_cache_dtype="fp8")  # fails before the folder check
    check_backend("fp8_e4m3")  # XLA CPU stores and converts float8_e4m3fn
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_storage_dtype == FP8
    assert EngineConfig(dtype="bfloat16").kv_storage_dtype == jnp.bfloat16

    from jbatch.cli import _build_parser

    args = _build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"


ENGINE = dict(
    max_slots=4, page_size=8, max_num_batched_tokens=16, block_q=8, max_seq_len=96,
    kv_cache_dtype="int8",
)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def _workload():
    rng = np.random.RandomState(4)
    system = rng.randint(3, 384, 24).tolist()  # a shared prefix: 3 full pages
    prompts = [system + rng.randint(3, 384, int(n)).tolist() for n in rng.randint(1, 12, 6)]
    prompts += [rng.randint(3, 384, int(n)).tolist() for n in (30, 45)]
    params = [GREEDY.replace(max_tokens=int(m)) for m in rng.randint(14, 30, len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def int8_runs(hf_checkpoint):
    """The workload through an int8 pool twice: roomy (no preemption, no prefix cache) and tiny
    (12 pages for 4 slots: swap preemption) with prefix caching; compilations after warm-up."""
    path, model = hf_checkpoint("llama")
    prompts, params = _workload()
    runs = {}
    for name, kw in {
        "plain": dict(num_pages=64, enable_prefix_caching=False),
        "swap_prefix": dict(num_pages=12, preemption_mode="swap"),
    }.items():
        llm = LLM(path, **ENGINE, **kw)
        with count_compiles() as compiled:
            outs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = dict(tokens=[o.outputs[0].token_ids for o in outs], compiled=compiled, llm=llm)
    return runs, model, prompts


def test_int8_engine_compiles_nothing_after_warmup(int8_runs):
    runs, _, _ = int8_runs
    for name, r in runs.items():
        assert r["compiled"] == [], f"{name}: recompiled {r['compiled']}"
        assert r["llm"].engine.state.cache.k[0].dtype == INT8


def test_int8_swap_and_prefix_cache_give_the_same_tokens(int8_runs):
    runs, _, _ = int8_runs
    llm = runs["swap_prefix"]["llm"]
    assert llm.engine.stats().swap_outs > 0, "the tiny pool did not force a swap"
    assert llm.engine.scheduler.allocator.hits > 0, "no prefix page was reused"
    assert runs["swap_prefix"]["tokens"] == runs["plain"]["tokens"]


def test_int8_batch_invariance(int8_runs):
    """A prompt alone on the int8 engine gets the tokens it got in the batch: quantization is per
    token and head, so a row's K/V never depends on its neighbours."""
    runs, _, prompts = int8_runs
    llm = runs["plain"]["llm"]
    _, params = _workload()
    for prompt, p, batched in zip(prompts, params, runs["plain"]["tokens"]):
        alone = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == batched


def test_int8_greedy_teacher_forced_agreement_with_hf(int8_runs):
    """Each generated token vs HF's float argmax given the same (generated) prefix."""
    runs, model, prompts = int8_runs
    agree = total = 0
    for prompt, out in zip(prompts, runs["plain"]["tokens"]):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0].numpy()
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]
        gap = rows.max(-1) - rows[np.arange(len(out)), out]
        agree, total = agree + int((gap <= 1e-3).sum()), total + len(out)
    assert agree / total >= 0.97, f"{agree}/{total} tokens are HF's argmax"


@pytest.fixture(scope="module", autouse=True)
def tp_worker(hf_checkpoint):
    """The tp=2 run in a subprocess (2 simulated CPU devices), started first so it overlaps the
    rest of this module: one device and tp=2, both int8, in one worker (compiled alike)."""
    from tests.test_parallel import _spawn

    proc = _spawn(["matrix", str(hf_checkpoint("llama_tp")[0]), "1x1::int8,2x1::int8"], 2)
    yield proc
    if proc.poll() is None:
        proc.kill()


def test_int8_pool_under_tensor_parallelism(tp_worker):
    """tp=2: the same tokens as one device (swapping through the sharded pool), no compile after
    warm-up, the scales split over KV heads like the pool."""
    from tests.test_parallel import _result

    r = _result(tp_worker)
    one, two = r["tp1_dp1_int8"], r["tp2_dp1_int8"]
    assert two["outputs"] == one["outputs"] and len(one["outputs"]) == 6
    assert two["compiles_after_warmup"] == [] and two["swap_outs"] > 0
    (rep,) = two["replicas"]
    assert len(rep["kv_scales"]) == 2 * 2  # K and V scales of 2 layers
    for pool, scales in zip(rep["kv"], rep["kv_scales"]):
        p, s, h, _ = pool["shape"]
        assert scales["spec"] == [None, None, "tp"]
        assert scales["shape"] == [p, s, h] and scales["shard_shapes"] == [[p, s, h // 2]]
        assert pool["shard_shapes"][0][2] == h // 2
