"""The ragged Pallas paged-attention kernel against the pure-JAX reference and JAX's own kernel.

``TestRaggedPagedAttention`` runs the kernel natively and is skipped unless the default backend
is a GPU; ``TestRaggedPagedAttentionInterpret`` runs the very same tests in Pallas interpret mode
(the pattern of JAX's own Pallas tests), which is what CPU CI exercises. Sizes are tiny: interpret
mode compiles a whole grid loop per static configuration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    cpu_attention,
    paged_attention,
    paged_attention_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    resolve_impl,
)
from pallas_kernels.cross_lowering import gpu_lowering_context

ON_GPU = jax.default_backend() == "gpu"
CPU_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def make_ragged(rng, *, query_lens, h, kvh, d, page_size, max_pages, dtype=np.float32, extra=0):
    """Sequences of random context (>= their query rows) written into a NaN-filled pool through
    scrambled page tables; unused table entries point at random (NaN or foreign) pages."""
    s = len(query_lens)
    num_pages = s * max_pages + 3
    seq_lens = np.array(
        [rng.randint(max(ql, 1), max_pages * page_size + 1) for ql in query_lens], np.int32
    )
    tables = rng.permutation(num_pages)[: s * max_pages].reshape(s, max_pages).astype(np.int32)
    k_pool = np.full((num_pages, page_size, kvh, d), np.nan, np.float32)
    v_pool = np.full((num_pages, page_size, kvh, d), np.nan, np.float32)
    for i in range(s):
        n = int(seq_lens[i])
        k_pool[tables[i, np.arange(n) // page_size], np.arange(n) % page_size] = rng.randn(
            n, kvh, d
        )
        v_pool[tables[i, np.arange(n) // page_size], np.arange(n) % page_size] = rng.randn(
            n, kvh, d
        )
        used = -(-n // page_size)
        tables[i, used:] = rng.randint(0, num_pages, max_pages - used)
    query_starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    q = rng.randn(int(query_starts[-1]) + extra, h, d)  # `extra` rows belong to no sequence
    cast = lambda x: jnp.asarray(x, dtype)
    return (
        cast(q),
        cast(k_pool),
        cast(v_pool),
        jnp.asarray(tables),
        jnp.asarray(seq_lens),
        jnp.asarray(query_starts),
    )


# A covering set, not a cartesian product: every value of each axis appears at least once.
CASES = {
    "f32_mixed_mha_d64": dict(
        query_lens=[1, 7, 1, 3, 0, 1], h=2, kvh=2, d=64, page_size=8, max_pages=5
    ),
    "f32_mixed_gqa4_d128_window_split": dict(
        query_lens=[5, 1, 9, 1],
        h=8,
        kvh=2,
        d=128,
        page_size=16,
        max_pages=4,
        kw=dict(sliding_window=11, num_kv_splits=2, pages_per_block=1),
    ),
    "bf16_mixed_gqa8_softcap_split3": dict(
        query_lens=[1, 12, 1],
        h=8,
        kvh=1,
        d=64,
        page_size=4,
        max_pages=12,
        dtype=jnp.bfloat16,
        kw=dict(soft_cap=2.0, num_kv_splits=3, block_q=4),
        extra=3,
    ),
    "bf16_decode_gqa2_d128": dict(
        query_lens=[1] * 5,
        h=4,
        kvh=2,
        d=128,
        page_size=8,
        max_pages=6,
        dtype=jnp.bfloat16,
        kw=dict(max_query_len=1),
    ),
    "f32_prefill_gqa3_nonpow2_group": dict(
        query_lens=[16, 6],
        h=6,
        kvh=2,
        d=64,
        page_size=8,
        max_pages=4,
        kw=dict(block_q=8),
    ),
}


class TestRaggedPagedAttention:
    """Native: runs the kernel compiled for the GPU (skipped elsewhere)."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if not self.INTERPRET and not ON_GPU:
            pytest.skip("native Pallas GPU kernel: needs a GPU (the interpret subclass runs here)")

    def call(self, *args, **kw):
        return self.run_fast(
            lambda *a: ragged_paged_attention(*a, interpret=self.INTERPRET, **kw), *args
        )

    def run_fast(self, fn, *args):
        """Interpret mode: compile the (large) interpreter program without backend optimisation,
        3x faster to build on CPU; the kernel semantics do not depend on it."""
        lowered = jax.jit(fn).lower(*args)
        opts = CPU_FAST_COMPILE if self.INTERPRET and not ON_GPU else None
        return lowered.compile(compiler_options=opts)(*args)

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_matches_reference(self, name):
        case = dict(CASES[name])
        kw, dtype = case.pop("kw", {}), case.get("dtype", np.float32)
        args = make_ragged(np.random.RandomState(len(name)), **case)
        got = np.asarray(self.call(*args, **kw), np.float32)
        ref_kw = {k: kw[k] for k in ("sliding_window", "soft_cap") if k in kw}
        want = np.asarray(ragged_paged_attention_reference(*args, **ref_kw), np.float32)
        assert np.isfinite(got).all(), "NaN from unused pages leaked into the result"
        tol = 2e-2 if dtype == jnp.bfloat16 else (2e-5 if self.INTERPRET else 1e-4)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
        inside = int(args[5][-1])
        assert (got[inside:] == 0).all(), "rows outside every sequence must be zero"

    def test_kv_split_does_not_change_result(self):
        args = make_ragged(
            np.random.RandomState(7),
            query_lens=[1, 4, 1],
            h=4,
            kvh=1,
            d=64,
            page_size=4,
            max_pages=16,
        )
        one = np.asarray(self.call(*args, num_kv_splits=1))
        four = np.asarray(self.call(*args, num_kv_splits=4))
        np.testing.assert_allclose(four, one, atol=1e-5, rtol=1e-5)

    def test_decode_matches_jax_gpu_paged_attention(self):
        """All-decode batch vs jax.experimental.pallas.ops.gpu.paged_attention ([KVH, P, S, D])."""
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_pa

        s, max_pages, page_size = 3, 4, 16
        q, kp, vp, tables, seq_lens, qs = make_ragged(
            np.random.RandomState(3),
            query_lens=[1] * s,
            h=16,
            kvh=2,
            d=64,
            page_size=page_size,
            max_pages=max_pages,
        )
        # JAX's kernel does not scale logits by 1/sqrt(D): compare at scale 1.
        got = np.asarray(self.call(q, kp, vp, tables, seq_lens, qs, max_query_len=1, scale=1.0))
        # It masks but does not zero keys past the length: give it finite pages.
        finite = lambda x: jnp.nan_to_num(x).transpose(2, 0, 1, 3)  # [KVH, P, S, D]
        theirs = self.run_fast(
            lambda *a: jax_pa(*a, k_splits=2, pages_per_compute_block=2, interpret=self.INTERPRET),
            q,
            finite(kp),
            finite(vp),
            tables,
            seq_lens,
        )
        theirs = np.asarray(theirs)
        np.testing.assert_allclose(got, theirs, atol=2e-5, rtol=1e-4)

    def test_block_dispatch_matches_reference(self):
        """paged_attention(impl=pallas) on the block contract, padding rows at the blocks' ends."""
        _, kp, vp, tables, seq_lens, _ = make_ragged(
            np.random.RandomState(11),
            query_lens=[4, 2, 3],
            h=4,
            kvh=2,
            d=16,
            page_size=8,
            max_pages=3,
        )
        pos = np.full((3, 4), -1, np.int32)
        for i, n in enumerate([4, 2, 3]):
            pos[i, :n] = np.arange(int(seq_lens[i]) - n, int(seq_lens[i]))
        qb = jnp.asarray(np.random.RandomState(1).randn(3, 4, 4, 16), jnp.float32)
        impl = "pallas_interpret" if self.INTERPRET else "pallas"
        got = self.run_fast(
            lambda *a: paged_attention(*a, sliding_window=3, impl=impl),
            qb,
            kp,
            vp,
            tables,
            jnp.asarray(pos),
        )
        want = paged_attention_reference(qb, kp, vp, tables, jnp.asarray(pos), sliding_window=3)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)
        assert (np.asarray(got)[pos < 0] == 0).all()


class TestRaggedPagedAttentionInterpret(TestRaggedPagedAttention):
    """The same tests in Pallas interpret mode (any backend)."""

    INTERPRET = True


def test_reference_soft_cap_matches_numpy():
    """The reference's soft cap and ragged positions, against a float64 loop."""
    q, kp, vp, tables, seq_lens, qs = make_ragged(
        np.random.RandomState(2), query_lens=[2, 1], h=2, kvh=1, d=16, page_size=4, max_pages=3
    )
    got = np.asarray(
        jax.jit(ragged_paged_attention_reference, static_argnames="soft_cap")(
            q, kp, vp, tables, seq_lens, qs, soft_cap=1.5
        )
    )
    kp, vp, q = np.asarray(kp, np.float64), np.asarray(vp, np.float64), np.asarray(q, np.float64)
    for i in range(2):
        n, start, ql = int(seq_lens[i]), int(qs[i]), int(qs[i + 1] - qs[i])
        idx = np.arange(n)
        keys, vals = kp[tables[i, idx // 4], idx % 4, 0], vp[tables[i, idx // 4], idx % 4, 0]
        for r in range(ql):
            p = n - ql + r
            for head in range(2):
                logit = 1.5 * np.tanh(keys[: p + 1] @ q[start + r, head] / 4.0 / 1.5)
                w = np.exp(logit - logit.max())
                np.testing.assert_allclose(
                    got[start + r, head], w @ vals[: p + 1] / w.sum(), atol=1e-5
                )


BAD = [
    ("heads", dict(h=6, kvh=4), "H=6 not divisible by KV heads KVH=4"),
    ("head_dim", dict(d=24), "head dim D=24 not supported"),
    ("dtype", dict(k_dtype=jnp.bfloat16), "dtypes must match"),
    ("page_size", dict(page_size=12), "page size S=12"),
    ("query_starts", dict(qs_len=3), r"query_starts \(3,\) must be \[S \+ 1\] = \[4\]"),
    ("index_dtype", dict(lens_dtype=jnp.float32), "'seq_lens': 'float32'"),
]


@pytest.mark.parametrize("what,change,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_value_error(what, change, msg):
    h, kvh, d, ps = change.get("h", 4), change.get("kvh", 2), change.get("d", 16), 8
    ps = change.get("page_size", ps)
    q = jnp.zeros((5, h, d), jnp.float32)
    kp = jnp.zeros((6, ps, kvh, d), change.get("k_dtype", jnp.float32))
    vp = jnp.zeros((6, ps, kvh, d), jnp.float32)
    qs = jnp.zeros((change.get("qs_len", 4),), jnp.int32)
    with pytest.raises(ValueError, match=msg):
        ragged_paged_attention(
            q,
            kp,
            vp,
            jnp.zeros((3, 2), jnp.int32),
            jnp.ones(3, change.get("lens_dtype", jnp.int32)),
            qs,
            interpret=True,
        )


def test_auto_resolves_by_backend():
    on_cpu = "cpu" if cpu_attention.available() else "xla"  # the native kernel, when it builds
    assert resolve_impl("auto") == ("pallas" if ON_GPU else on_cpu)
    assert resolve_impl("pallas_interpret") == "pallas_interpret"


def test_lowers_for_cuda_without_a_gpu():
    """Pallas -> Triton IR lowering runs in Python: export for CUDA from any host."""
    sd = jax.ShapeDtypeStruct
    args = [sd((96, 32, 128), jnp.bfloat16), sd((512, 16, 8, 128), jnp.bfloat16)] * 1
    args += [args[1], sd((40, 64), jnp.int32), sd((40,), jnp.int32), sd((41,), jnp.int32)]
    try:
        with gpu_lowering_context():  # jax >= 0.11 asks the target GPU while lowering Triton
            exported = jax.export.export(
                jax.jit(lambda *a: ragged_paged_attention(*a, max_query_len=16, soft_cap=30.0)),
                platforms=["cuda"],
                disabled_checks=[
                    jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
                ],
            )(*args)
    except (NotImplementedError, jax.errors.JaxRuntimeError) as e:  # pragma: no cover
        pytest.skip(f"this jax cannot lower Pallas for cuda off-GPU: {e}")
    module = exported.mlir_module()
    assert module.count("__gpu$xla.gpu.triton") == 1, "expected exactly one Triton kernel"
    assert "ragged_paged_attention_m64" in module


def test_engine_greedy_tokens_match_reference(hf_checkpoint):
    """End to end (mistral: sliding window 12): the engine with the kernel in interpret mode
    produces the reference path's greedy tokens, through steps mixing decodes and prompt chunks."""
    from jbatch import LLM, SamplingParams

    path, _ = hf_checkpoint("mistral")
    engine = dict(
        max_slots=3, page_size=8, num_pages=24, max_num_batched_tokens=8, max_seq_len=64, block_q=8
    )
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, 384, size=n).tolist() for n in (3, 21, 9, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for impl in ("reference", "pallas_interpret"):
        llm = LLM(path, attn_impl=impl, warmup=False, **engine)  # compile only the shapes used
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[impl] = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 8 for t in tokens["reference"])
    assert tokens["pallas_interpret"] == tokens["reference"]


def test_model_step_lowers_for_cuda_with_one_ragged_call_per_layer(hf_checkpoint):
    """The engine's flat batch (decode rows + prompt blocks) goes through ONE kernel per layer."""
    import re

    from jbatch.checkpoint import load_model
    from jbatch.models.kv_cache import KVCache
    from jbatch.models.llama import forward

    cfg, params = load_model(hf_checkpoint("llama")[0], dtype="bfloat16")
    as_sds = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    cache = jax.eval_shape(lambda: KVCache.zeros(cfg, 24, 8, jnp.bfloat16))
    num_decode, block_q, t = 4, 8, 4 + 2 * 8
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

    def step(params, cache, tokens, positions, slots, tables):
        kw = dict(num_decode=num_decode, block_q=block_q, attn_impl="pallas")
        return forward(params, cfg, cache, tokens, positions, slots, tables, **kw)

    with gpu_lowering_context():
        exported = jax.export.export(
            jax.jit(step),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(as_sds(params), cache, i32(t), i32(t), i32(t), i32(4, 8))
    module = exported.mlir_module()
    calls = len(re.findall(r"call @ragged_paged_attention", module))
    calls = calls or module.count("__gpu$xla.gpu.triton")  # if a jax version inlines the jit
    assert calls == cfg.num_layers
