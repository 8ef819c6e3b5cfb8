"""Weight-only int8 quantization: the math, load-time quantization, the quantized forward against
HF (with the dequantized weights, and with the float ones), and the engine's invariants with
``quantization="int8"`` (0 recompiles, batch invariance, swap preemption, tp=2)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jbatch import LLM, EngineConfig, SamplingParams
from jbatch.checkpoint import load_model, restore_params, save_params
from jbatch.models import quant
from jbatch.parallel.loading import params_bytes
from jbatch.param_layout import _LAYER_TENSORS
from tests.compile_counter import count_compiles
from tests.test_engine import assert_drained, assert_teacher_forced
from tests.test_model_vs_hf import PagedRunner, hf_logits, rel_err, scrambled_tables

ROOT = Path(__file__).resolve().parents[1]
INT8 = quant.WeightQuant("int8")
HEAD = quant.WeightQuant("int8", lm_head=True)
ENGINE = dict(
    max_slots=4, page_size=4, num_pages=24, max_num_batched_tokens=32, max_seq_len=96,
    block_q=8, preemption_mode="swap", quantization="int8", debug_checks=True,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
# HF linear modules behind each quantized jbatch layer weight.
_HF_LINEARS = {k: _LAYER_TENSORS[k].name.rsplit(".", 1)[0] for k in quant.QUANTIZED_LAYER_WEIGHTS}

TP_SCRIPT = """
import json, sys
from jbatch.models.config import ModelConfig
from jbatch.parallel import build_engines
from tests.compile_counter import count_compiles
from tests.parallel_worker import describe, engine_config, run_workload
ckpt = sys.argv[1]
cfg = ModelConfig.from_file(ckpt + "/config.json")
out = {}
for tp in (1, 2):
    (engine,) = build_engines(cfg, engine_config(tp=tp, quantization="int8"), model_dir=ckpt)
    with count_compiles() as compiled:
        outs = run_workload(engine)
    layers = engine.params["layers"]
    out[tp] = dict(outputs=outs, compiles=compiled, swap_outs=engine.stats().swap_outs,
                   wq=describe(layers["wq"]), wq_scale=describe(layers["wq_scale"]),
                   wo_scale=describe(layers["wo_scale"]))
print("RESULT " + json.dumps(out))
"""


def dequantized_hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of an HF model whose linear weights are jbatch's int8 weights, dequantized."""
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        for name in _HF_LINEARS.values():
            lin = layer.get_submodule(name)
            w = lin.weight.detach().numpy().T  # jbatch layout [in, out]
            q, s = quant.quantize(w, axis=-2)
            lin.weight.data = torch.from_numpy(np.ascontiguousarray(quant.dequantize(q, s).T))
    return model


@pytest.fixture(scope="module")
def tp_run(hf_checkpoint):
    """The tp=2 subprocess starts first and runs while the other tests do."""
    path = str(hf_checkpoint("llama_tp")[0])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    cmd = [sys.executable, "-c", TP_SCRIPT, path]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    path, model = hf_checkpoint("llama")
    return path, model, dequantized_hf_model(model)


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(llama[0], **ENGINE)


def test_tp_run_started(tp_run):
    assert tp_run.poll() in (None, 0)


@pytest.mark.parametrize("shape", [(64, 48), (3, 64, 48), (2, 3, 64, 48)])  # layers, experts
def test_round_trip_error_is_half_a_step(shape):
    w = np.random.RandomState(0).standard_normal(shape).astype(np.float32)
    w[..., 5] = 0.0  # an all-zero output channel
    q, s = quant.quantize(w, axis=-2)
    assert q.dtype == np.int8 and q.shape == w.shape and s.shape == shape[:-2] + shape[-1:]
    assert np.abs(q).max() == 127 and np.all(q[..., 5] == 0) and np.all(s[..., 5] == 1)
    err = np.abs(quant.dequantize(q, s) - w)
    assert np.all(err <= s[..., None, :] / 2 * (1 + 1e-6))
    qj, sj = quant.quantize(jnp.asarray(w), axis=-2)  # jax and numpy agree
    np.testing.assert_array_equal(np.asarray(qj), q)
    np.testing.assert_allclose(np.asarray(sj), s, rtol=1e-6)


def test_every_linear_layer_weight_is_quantized():
    linear = {k for k, source in _LAYER_TENSORS.items() if source.linear}
    assert linear == set(quant.QUANTIZED_LAYER_WEIGHTS)


def test_loaded_int8_params_are_a_quarter_and_restore_as_saved(llama, tmp_path):
    cfg, floats = load_model(llama[0])
    _, ints = load_model(llama[0], quant=HEAD)
    assert ints["layers"]["wq"].dtype == jnp.int8 and ints["lm_head"].dtype == jnp.int8
    assert ints["layers"]["wq_scale"].shape == (cfg.num_layers, cfg.num_heads * cfg.head_dim)
    linear = lambda p: {k: p["layers"][k] for k in p["layers"] if k.startswith("w")}
    ratio = params_bytes(linear(floats)) / params_bytes(linear(ints))
    assert 3.5 < ratio < 4.0, ratio
    assert params_bytes(ints) < 0.45 * params_bytes(floats)  # the float embedding remains
    in_memory = quant.quantize_params(floats, HEAD)  # same as quantizing while loading
    for k, v in ints["layers"].items():  # (XLA's division may differ from numpy's in the ulp)
        got, want = np.asarray(v, np.float32), np.asarray(in_memory["layers"][k], np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1 if v.dtype == jnp.int8 else 0)
    save_params(tmp_path / "ckpt", ints)
    back = restore_params(tmp_path / "ckpt", cfg, dtype="bfloat16")
    assert back["layers"]["w_up"].dtype == jnp.int8 and back["lm_head_scale"].dtype == jnp.float32
    assert back["final_norm"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back["layers"]["w_up"]), ints["layers"]["w_up"])


@pytest.mark.parametrize("variant", ["llama", "qwen2"])  # qwen2: tied head (int8 embedding)
def test_int8_forward_vs_float_and_dequantized_hf(variant, hf_checkpoint):
    """The int8 forward equals HF run with the dequantized weights (the matmul dequantizes
    exactly) and stays close to the float model: logits and teacher-forced argmax."""
    path, model = hf_checkpoint(variant)
    cfg, params = load_model(path, quant=INT8)
    ids = np.random.RandomState(1).randint(0, cfg.vocab_size, 64)
    runner = PagedRunner(cfg, params, 8, scrambled_tables(2, 48, seed=0), prefill_rows=64)
    (got,) = runner.step([], [(0, ids, 0)])
    assert rel_err(got, hf_logits(dequantized_hf_model(model), ids)) < 1e-4
    want = hf_logits(model, ids)
    assert rel_err(got, want) < 0.03
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
    if variant == "qwen2":  # the tied embedding quantized too: lookups and head dequantize
        _, params = load_model(path, quant=HEAD)
        assert params["embed"].dtype == jnp.int8 and "embed_scale" in params
        runner = PagedRunner(cfg, params, 8, scrambled_tables(2, 48, seed=0), prefill_rows=64)
        (head,) = runner.step([], [(0, ids, 0)])
        assert rel_err(head, want) < 0.04


def test_engine_int8_no_recompiles_swap_and_matches_dequantized_hf(llm, llama):
    """A pool too small for the workload (swap preemption): every token is the dequantized
    model's argmax, and nothing compiles after warm-up."""
    rng = np.random.RandomState(4)
    prompts = [rng.randint(3, 384, int(n)).tolist() for n in rng.randint(1, 60, 8)]
    params = [GREEDY.replace(max_tokens=int(m)) for m in rng.randint(4, 30, 8)]
    with count_compiles() as compiled:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(llama[2], prompt, out.outputs[0].token_ids)
    assert llm.engine.stats().swap_outs > 0
    assert_drained(llm)


def test_engine_int8_batch_invariance(llm):
    rng = np.random.RandomState(6)
    prompts = [rng.randint(3, 384, int(n)).tolist() for n in (3, 40, 17, 1)]
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, together):
        alone = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(quantization="int4"), "quantization must be one of .*'int4'"),
        (dict(quantize_lm_head=True), "quantize_lm_head=True needs quantization"),
    ],
)
def test_bad_options_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_prequantized_checkpoint_refused_before_loading(llama, tmp_path):
    cfg = json.loads((Path(llama[0]) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights at all: never read
    with pytest.raises(ValueError, match="already quantized.*compressed-tensors"):
        LLM(tmp_path, quantization="int8")


def test_tp2_int8_matches_one_device(tp_run):
    out, err = tp_run.communicate(timeout=600)
    lines = [line for line in out.decode().splitlines() if line.startswith("RESULT ")]
    assert tp_run.returncode == 0 and lines, err.decode()[-4000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    one, two = res["1"], res["2"]
    assert two["outputs"] == one["outputs"]
    assert two["compiles"] == [] and two["swap_outs"] > 0
    assert two["wq"]["spec"] == [None, None, "tp"] and two["wq_scale"]["spec"] == [None, "tp"]
    assert two["wo_scale"]["spec"] == []  # row-parallel wo: its scales replicated
