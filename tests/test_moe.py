"""Mixtures of experts (Mixtral, Qwen3-MoE) against HF transformers: the grouped expert matmul,
routing, loading both expert layouts, the paged forward and greedy decoding through the engine."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch

from jbatch import LLM, SamplingParams
from jbatch.checkpoint import (
    load_model,
    load_params,
    restore_params,
    save_params,
)
from jbatch.models import moe
from jbatch.models.config import ConfigError, ModelConfig
from jbatch.models.llama import forward
from jbatch.outputs import OutputKind
from jbatch.param_layout import expected_param_shapes
from tests.compile_counter import count_compiles
from tests.hf_models import MOE_VARIANTS
from tests.test_engine import assert_drained, assert_teacher_forced
from tests.test_model_vs_hf import nan_cache, scrambled_tables
from tests.test_model_vs_hf import test_chunked_prefill_then_decode_match_hf as check_paged_vs_hf

VARIANTS = list(MOE_VARIANTS)


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request, hf_checkpoint):
    path, model = hf_checkpoint(request.param)
    cfg, params = load_model(path, dtype="float32")
    return request.param, cfg, params, model


# ---- the expert MLP on its own -------------------------------------------------------------


def _dense_reference(x, weights, ids, w_gate, w_up, w_down):
    """Every expert on every row, then the routing weights pick: O(tokens x experts)."""
    h = jax.nn.silu(jnp.einsum("te,nef->tnf", x, w_gate)) * jnp.einsum("te,nef->tnf", x, w_up)
    y = jnp.einsum("tnf,nfe->tne", h, w_down)  # [T, N, E]
    picked = jnp.take_along_axis(y, ids[:, :, None], axis=1)  # [T, k, E]
    return jnp.einsum("tk,tke->te", weights, picked)


def test_grouped_matmul_equals_dense_and_padding_is_inert():
    """Both grouped implementations equal the all-experts reference on the real rows; padding
    rows (NaN inputs, any routing) give 0 and leave every real row bit-identical."""
    rng = np.random.RandomState(0)
    t, e, f, n, k = 40, 16, 24, 6, 2
    x = jnp.asarray(rng.randn(t, e), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.randn(n, e, f), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.randn(n, f, e), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(n)[:k] for _ in range(t)]), jnp.int32)
    ids = ids.at[:25, 0].set(3)  # a crowded expert: several blocks
    weights = jnp.asarray(rng.rand(t, k), jnp.float32)
    valid = jnp.asarray(rng.rand(t) < 0.7)
    ref = _dense_reference(x, weights, ids, w_gate, w_up, w_down)
    run = jax.jit(moe.expert_outputs, static_argnames="impl")
    for impl in moe.IMPLS:
        got = np.asarray(run(x, weights, ids, valid, w_gate, w_up, w_down, impl=impl))
        np.testing.assert_allclose(got[valid], ref[valid], rtol=1e-4, atol=1e-3)
        assert not got[~valid].any()
        junk_x = jnp.where(valid[:, None], x, jnp.nan)
        junk_ids = jnp.where(valid[:, None], ids, (ids + 1) % n)
        junk = np.asarray(run(junk_x, weights, junk_ids, valid, w_gate, w_up, w_down, impl=impl))
        np.testing.assert_array_equal(junk, got)
    with pytest.raises(ValueError, match="'dense'"):
        moe.expert_outputs(x, weights, ids, valid, w_gate, w_up, w_down, impl="dense")


def test_routing_weights_follow_norm_topk_prob():
    cfg = ModelConfig("mixtral", 64, 8, 16, 1, 2, 2, 4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=8, norm_topk_prob=True)  # fmt: skip
    x = jnp.asarray(np.random.RandomState(1).randn(5, 8), jnp.float32)
    router = jnp.asarray(np.random.RandomState(2).randn(8, 4), jnp.float32)
    probs = np.asarray(jax.nn.softmax(x @ router, axis=-1))
    top = np.sort(probs, axis=-1)[:, ::-1][:, :2]
    w, ids = moe.route(x, router, cfg)
    np.testing.assert_allclose(w, top / top.sum(-1, keepdims=True), rtol=1e-6)
    assert (np.take_along_axis(probs, np.asarray(ids), 1) == top).all()
    w, _ = moe.route(x, router, dataclasses.replace(cfg, norm_topk_prob=False))
    np.testing.assert_allclose(w, top, rtol=1e-6)


# ---- config and loading --------------------------------------------------------------------


def test_config_layers_and_errors(hf_checkpoint):
    cfg = ModelConfig.from_file(hf_checkpoint("qwen3_moe")[0] / "config.json")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 2, 48)
    assert cfg.moe_layers == (True, False, True) and cfg.qk_norm and not cfg.norm_topk_prob
    mixtral = ModelConfig.from_file(hf_checkpoint("mixtral")[0] / "config.json")
    assert mixtral.moe_layers == (True, True) and mixtral.norm_topk_prob
    assert mixtral.sliding_windows == (24, 24)
    base = json.loads((hf_checkpoint("qwen3_moe")[0] / "config.json").read_text())
    step2 = ModelConfig.from_hf_dict({**base, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert step2.moe_layers == (False, True, False)
    bad = {
        "num_experts_per_tok": (dict(num_experts_per_tok=7), "num_experts_per_tok=7"),
        "decoder_sparse_step": (dict(decoder_sparse_step=0), "decoder_sparse_step"),
        "mlp_only_layers": (dict(mlp_only_layers=[5]), "mlp_only_layers"),
        "moe_intermediate_size": (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    }
    for overrides, match in bad.values():
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_hf_dict({**base, **overrides})
    no_experts = {k: v for k, v in base.items() if k not in ("num_local_experts", "num_experts")}
    with pytest.raises(ConfigError, match="num_local_experts"):
        ModelConfig.from_hf_dict(no_experts)


def test_fused_expert_layout_and_orbax_round_trip(variant, tmp_path):
    """transformers' in-memory fused experts (``mlp.experts.gate_up_proj``) load to the same
    params as the per-expert files ``save_pretrained`` writes; orbax restores them."""
    _, cfg, params, model = variant
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    fused = load_params(tmp_path, cfg)
    jax.tree.map(np.testing.assert_array_equal, fused, params)
    shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    assert shapes == expected_param_shapes(cfg)
    save_params(tmp_path / "orbax", params)
    restored = restore_params(tmp_path / "orbax", cfg)
    jax.tree.map(np.testing.assert_array_equal, restored, params)


# ---- the model -----------------------------------------------------------------------------


def test_paged_forward_matches_hf(variant):
    """Chunked prefill while another sequence decodes, scrambled page tables, NaN pool."""
    check_paged_vs_hf(variant, "xla")


def test_one_step_routes_tokens_to_many_experts(variant):
    """In one step (two sequences' prompt blocks, padding rows) the real tokens of every MoE
    layer go to several experts, none taking them all: the dispatch sorts a mixed buffer."""
    _, cfg, params, _ = variant
    seen = []

    def recording(x, weights, ids, valid, *rest):
        jax.debug.callback(lambda i, v: seen.append((np.asarray(i), np.asarray(v))), ids, valid)
        return moe.expert_outputs(x, weights, ids, valid, *rest)

    # 2 padding decode rows, then blocks of 8: slot 0's 8 prompt tokens, slot 1's 5 (+3 padding)
    tokens = np.random.RandomState(4).randint(3, 384, 18).astype(np.int32)
    positions = np.array([-1, -1, *range(8), *range(5), -1, -1, -1], np.int32)
    slots = np.array([0, 0] + [0] * 8 + [1] * 8, np.int32)
    run = jax.jit(lambda *a: forward(params, cfg, *a, num_decode=2, block_q=8, experts=recording))
    cache = nan_cache(cfg, 4)
    jax.block_until_ready(run(cache, tokens, positions, slots, scrambled_tables(2, 24, seed=5)))
    assert len(seen) == sum(cfg.moe_layers)
    for ids, valid in seen:
        assert valid.sum() == 13
        top1 = np.bincount(ids[valid, 0], minlength=cfg.num_experts)
        assert (top1 > 0).sum() >= 3 and top1.max() < 13, top1
        every = np.bincount(ids[valid].ravel(), minlength=cfg.num_experts)
        assert (every > 0).sum() >= cfg.num_experts // 2, every


# ---- through the engine --------------------------------------------------------------------

ENGINE = dict(  # 3 step programs: decode-only of 1 and 3 rows, 16 prompt rows + 3 decode rows
    max_slots=3,
    page_size=8,
    num_pages=48,
    max_num_batched_tokens=16,  # prompts longer than this are prefilled in chunks
    max_seq_len=160,
    block_q=16,
    debug_checks=True,
)


@pytest.fixture(scope="module")
def engine_run(hf_checkpoint):
    """Each variant's engine (built once) serves 7 requests arriving over the first steps;
    the whole run is counted for compilations (warm-up happened at construction)."""
    cache = {}

    def get(name):
        if name not in cache:
            path, model = hf_checkpoint(name)
            llm = LLM(path, **ENGINE)
            rng = np.random.RandomState(1)
            prompts = [rng.randint(3, 384, size=n).tolist() for n in (70, 3, 41, 1, 17, 90, 9)]
            outs: dict[str, list[int]] = {}
            with count_compiles() as compiled:
                for i, prompt in enumerate(prompts):  # one arrival per step
                    sp = SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True)
                    llm.engine.add_request(prompt, sp, f"r{i}", output_kind=OutputKind.FINAL)
                    outs.update(_finished(llm.engine.step()))
                while llm.engine.has_unfinished_requests():
                    outs.update(_finished(llm.engine.step()))
            llm.engine.forget_finished()
            cache[name] = (llm, model, prompts, outs, compiled)
        return cache[name]

    return get


def _finished(step_outputs) -> dict[str, list[int]]:
    return {o.request_id: list(o.outputs[0].token_ids) for o in step_outputs if o.finished}


@pytest.mark.parametrize("name", VARIANTS)
def test_engine_greedy_matches_hf_teacher_forced(engine_run, name):
    llm, model, prompts, outs, _ = engine_run(name)
    assert sorted(outs) == [f"r{i}" for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        assert len(outs[f"r{i}"]) == 6 + 2 * i
        assert_teacher_forced(model, prompt, outs[f"r{i}"])
    assert len({tuple(v) for v in outs.values()}) == len(prompts)
    ran = llm.engine.core.programs_run
    assert ran[(16, 3)] and ran[(0, 3)] and ran[(0, 1)], ran  # chunks beside decodes; decodes
    assert_drained(llm)


@pytest.mark.parametrize("name", VARIANTS)
def test_engine_no_compiles_after_warmup(engine_run, name):
    assert engine_run(name)[4] == []
