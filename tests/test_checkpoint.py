"""Tests for jbatch.checkpoint: HF safetensors loading, errors, generation config, orbax."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from jbatch.checkpoint import (
    GenerationConfig,
    load_generation_config,
    load_model,
    load_params,
    restore_params,
    save_params,
)
from jbatch.models.config import ModelConfig
from jbatch.param_layout import CheckpointError, expected_param_shapes

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

LAYER_MAP = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "b_gate": "mlp.gate_proj.bias",
    "b_up": "mlp.up_proj.bias",
    "b_down": "mlp.down_proj.bias",
}


def _make(kind: str, path: Path, *, torch_dtype=torch.float32, shard: str | None = None, **kw):
    """Save a tiny random HF model to ``path``; returns its float32 numpy state dict."""
    torch.manual_seed(0)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    model = model_cls(cfg_cls(**{**TINY, **kw})).to(torch_dtype)
    # Give norms / biases non-trivial values so a mix-up would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    extra = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **extra)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def _check_equal(params, sd, cfg: ModelConfig):
    shapes = expected_param_shapes(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(
        shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    np.testing.assert_array_equal(params["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], sd["model.norm.weight"])
    if cfg.tie_word_embeddings:
        assert "lm_head" not in params
    else:
        np.testing.assert_array_equal(params["lm_head"], sd["lm_head.weight"])
    for key, arr in params["layers"].items():
        assert arr.shape == shapes["layers"][key], key
        for i in range(cfg.num_layers):
            ref = sd[f"model.layers.{i}.{LAYER_MAP[key]}"]
            np.testing.assert_array_equal(arr[i], ref.T if ref.ndim == 2 else ref, err_msg=key)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    sd = _make("llama", path)
    return path, sd


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("mistral", {"sliding_window": 32}),
    ],
)
def test_load_matches_state_dict(tmp_path, kind, kw):
    sd = _make(kind, tmp_path, **kw)
    cfg, params = load_model(tmp_path)
    assert cfg.model_type == kind
    if kind == "qwen2":
        assert cfg.tie_word_embeddings and cfg.has_qkv_bias
        assert {"bq", "bk", "bv"} <= set(params["layers"]) and "bo" not in params["layers"]
    if kw.get("mlp_bias"):
        assert {"bo", "b_gate", "b_up", "b_down"} <= set(params["layers"])
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    _check_equal(params, sd, cfg)


def test_tied_ignores_lm_head_tensor(tmp_path):
    sd = _make("qwen2", tmp_path, tie_word_embeddings=True)
    f = tmp_path / "model.safetensors"
    tensors = safetensors.numpy.load_file(f)
    tensors["lm_head.weight"] = np.zeros((128, 64), np.float32)
    tensors["model.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)  # extra: ignored
    safetensors.numpy.save_file(tensors, f)
    cfg, params = load_model(tmp_path)
    assert "lm_head" not in params
    _check_equal(params, sd, cfg)


def test_sharded(tmp_path, llama_dir):
    src, sd = llama_dir
    _make("llama", tmp_path, shard="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    cfg, params = load_model(tmp_path)
    _check_equal(params, sd, cfg)
    _, ref = load_model(src)
    jax.tree.map(np.testing.assert_array_equal, params, ref)


def test_bfloat16_checkpoint(tmp_path):
    sd = _make("llama", tmp_path, torch_dtype=torch.bfloat16)
    cfg, params = load_model(tmp_path, dtype="bfloat16")
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(params))
    # bf16 -> f32 is exact, so compare in f32.
    _check_equal(jax.tree.map(lambda a: np.asarray(a, np.float32), params), sd, cfg)
    params32 = load_params(tmp_path, cfg, jnp.float32)
    _check_equal(params32, sd, cfg)


def test_float32_as_bfloat16_and_float16(llama_dir):
    src, sd = llama_dir
    cfg = ModelConfig.from_file(src / "config.json")
    for dt in ("bfloat16", jnp.float16):
        params = load_params(src, cfg, dtype=dt)
        assert all(a.dtype == jnp.dtype(dt) for a in jax.tree.leaves(params))
        np.testing.assert_array_equal(
            params["layers"]["wq"][1],
            jnp.asarray(sd["model.layers.1.self_attn.q_proj.weight"].T, dt),
        )


# ----------------------------------------------------------------------------- errors


def test_missing_dir_and_config(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope")
    d = _copy(llama_dir[0], tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(d)


def test_no_safetensors(tmp_path, llama_dir):
    d = _copy(llama_dir[0], tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_model(d)
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*not supported"):
        load_model(d)


def test_missing_shard(tmp_path):
    _make("llama", tmp_path, shard="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json.*{shard.name}.*missing"):
        load_model(tmp_path)


def _edit(d: Path, fn):
    f = d / "model.safetensors"
    tensors = safetensors.numpy.load_file(f)
    fn(tensors)
    safetensors.numpy.save_file(tensors, f)


def test_missing_tensor(tmp_path, llama_dir):
    d = _copy(llama_dir[0], tmp_path)
    _edit(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"
    ):
        load_model(d)


def test_missing_lm_head_untied(tmp_path, llama_dir):
    d = _copy(llama_dir[0], tmp_path)
    _edit(d, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_model(d)


def test_index_points_at_shard_without_tensor(tmp_path):
    _make("llama", tmp_path, shard="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.q_proj.weight"
    other = next(s for s in set(index["weight_map"].values()) if s != index["weight_map"][name])
    index["weight_map"][name] = other
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{other}.*{name}"):
        load_model(tmp_path)


def test_shape_mismatch(tmp_path, llama_dir):
    d = _copy(llama_dir[0], tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit(d, lambda t: t.__setitem__(name, np.zeros((64, 64), np.float32)))
    with pytest.raises(
        CheckpointError, match=rf"model\.safetensors.*{name}.*\(64, 64\).*expected \(32, 64\)"
    ):
        load_model(d)


def test_non_float_tensor(tmp_path, llama_dir):
    d = _copy(llama_dir[0], tmp_path)
    _edit(d, lambda t: t.__setitem__("model.norm.weight", np.zeros((64,), np.int32)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.norm\.weight.*I32"):
        load_model(d)


def test_bad_dtype_string(llama_dir):
    with pytest.raises(CheckpointError, match="unsupported dtype 'int8'"):
        load_model(llama_dir[0], dtype="int8")


def test_bad_config(tmp_path, llama_dir):
    d = _copy(llama_dir[0], tmp_path)
    hf = json.loads((d / "config.json").read_text())
    hf["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight.*expected \(96, 64\)"):
        load_model(d)


# ----------------------------------------------------------------------------- generation config


def test_generation_config(tmp_path, llama_dir):
    d = _copy(llama_dir[0], tmp_path)
    gen_file = d / "generation_config.json"
    gen_file.write_text(json.dumps({"eos_token_id": [5, 7], "bos_token_id": 1, "temperature": 0.6}))
    g = load_generation_config(d)
    assert g == GenerationConfig(eos_token_ids=(5, 7), bos_token_id=1, temperature=0.6)
    gen_file.write_text(json.dumps({"eos_token_id": 9, "top_k": 20, "top_p": 0.9}))
    g = load_generation_config(d)
    assert (g.eos_token_ids, g.top_k, g.top_p, g.max_new_tokens) == ((9,), 20, 0.9, None)
    gen_file.unlink()
    hf = json.loads((d / "config.json").read_text())
    hf.update(eos_token_id=[2, 3], bos_token_id=0)
    (d / "config.json").write_text(json.dumps(hf))
    assert load_generation_config(d) == GenerationConfig(eos_token_ids=(2, 3), bos_token_id=0)


# ----------------------------------------------------------------------------- orbax


def test_orbax_round_trip(tmp_path, llama_dir):
    cfg, params = load_model(llama_dir[0])
    ckpt = tmp_path / "ckpt"
    save_params(ckpt, params)
    save_params(ckpt, params)  # overwrite is fine
    restored = restore_params(ckpt, cfg)
    jax.tree.map(np.testing.assert_array_equal, restored, params)
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    half = restore_params(ckpt, cfg, dtype="bfloat16")
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(half))

    wrong = ModelConfig.from_hf_dict({**json.loads((llama_dir[0] / "config.json").read_text()),
                                      "intermediate_size": 96})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"ckpt.*w_gate.*expected \(2, 64, 96\)"):
        restore_params(ckpt, wrong)
    tied = ModelConfig.from_hf_dict({**json.loads((llama_dir[0] / "config.json").read_text()),
                                     "tie_word_embeddings": True})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"ckpt.*extra.*lm_head"):
        restore_params(ckpt, tied)
    (tmp_path / "junk").mkdir()
    with pytest.raises(CheckpointError, match="junk"):
        restore_params(tmp_path / "junk", cfg)
    with pytest.raises(FileNotFoundError, match="absent"):
        restore_params(tmp_path / "absent", cfg)
