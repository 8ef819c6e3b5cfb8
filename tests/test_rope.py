"""RoPE tables against HF transformers' own rotary embedding modules, per scaling type and per
layer type, at positions inside and past the original context (LongRoPE's long factors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jbatch.models.config import ConfigError, ModelConfig
from jbatch.models.rope import rope_tables
from tests.hf_models import _BASE, VARIANTS


def hf_model(name: str, **extra):
    cfg_cls, model_cls, overrides = VARIANTS[name]
    cfg = getattr(transformers, cfg_cls)(**{**_BASE, **overrides, **extra})
    return cfg, getattr(transformers, model_cls)(cfg).eval()


def hf_tables(model, positions, layer_type=None):
    rotary = model.model.rotary_emb
    x = torch.zeros(1, len(positions), 8)
    kwargs = {"layer_type": layer_type} if layer_type else {}
    with torch.no_grad():
        cos, sin = rotary(x, torch.tensor(positions)[None], **kwargs)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


def ours(cfg: ModelConfig, layer: int, positions):
    cos, sin = rope_tables(cfg.ropes[layer], cfg.head_dim, np.asarray(positions, np.int32))
    return np.asarray(cos), np.asarray(sin)


def assert_same(hf, mine):
    for a, b in zip(hf, mine):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "llama_linear_rope", "qwen3", "phi3"])
def test_tables_match_hf(name):
    hf_cfg, model = hf_model(name)
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    positions = list(range(0, 200, 3))
    assert_same(hf_tables(model, positions), ours(cfg, 0, positions))


def test_longrope_long_factors_past_the_original_window():
    """Past original_max_position_embeddings HF switches to the long factors; jbatch does so per
    token (see jbatch.models.rope), so a window wholly past it matches HF, and the tables differ
    from the short ones there."""
    hf_cfg, model = hf_model("phi3")
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    rope = cfg.ropes[0]
    assert rope.rotary_dim == cfg.head_dim // 2 and rope.attention_factor > 1
    past = list(range(256, 500, 7))
    assert_same(hf_tables(model, past), ours(cfg, 0, past))
    short = hf_tables(model, list(range(200)))[0][-1]
    assert not np.allclose(ours(cfg, 0, [199])[0][0], ours(cfg, 0, [256])[0][0])
    np.testing.assert_allclose(ours(cfg, 0, [199])[0][0], short, rtol=2e-5, atol=2e-5)


def test_gemma3_local_and_global_layers_rotate_differently():
    hf_cfg, model = hf_model("gemma3")
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    assert cfg.sliding_windows == (8, None, 8)
    assert cfg.ropes[0] == cfg.ropes[2] != cfg.ropes[1]
    positions = list(range(0, 300, 5))
    assert_same(hf_tables(model, positions, "sliding_attention"), ours(cfg, 0, positions))
    assert_same(hf_tables(model, positions, "full_attention"), ours(cfg, 1, positions))


def test_dynamic_ntk_equals_default_within_max_position_embeddings():
    hf_cfg, model = hf_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    assert cfg.ropes[0].rope_type == "dynamic"
    positions = list(range(0, _BASE["max_position_embeddings"], 9))
    assert_same(hf_tables(model, positions), ours(cfg, 0, positions))


def test_gemma3_legacy_config_fields():
    """Hub Gemma 3 configs predate rope_parameters: rope_theta + rope_scaling for global layers,
    rope_local_base_freq for local ones, sliding_window_pattern for the layer types."""
    hf = dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=6, num_attention_heads=2, head_dim=16,
        rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=4, sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )  # fmt: skip
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.sliding_windows == (4, 4, None, 4, 4, None)
    local, full = cfg.ropes[0], cfg.ropes[2]
    assert (local.theta, local.rope_type) == (1e4, "default")
    assert (full.theta, full.rope_type, full.factor) == (1e6, "linear", 8.0)
    assert cfg.tie_word_embeddings and cfg.norm_offset == 1.0 and cfg.qk_norm


def test_phi3_windows_every_layer_when_configured():
    hf_cfg, _ = hf_model("phi3", sliding_window=32)
    assert ModelConfig.from_hf_dict(hf_cfg.to_dict()).sliding_windows == (32, 32)


def test_multimodal_gemma3_folder_uses_its_text_config():
    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, head_dim=16, sliding_window=4,
    )  # fmt: skip
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
    cfg = ModelConfig.from_hf_dict(hf)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size) == ("gemma3", 2, 32)


@pytest.mark.parametrize(
    "rope,match",
    [
        ({"rope_type": "longrope", "short_factor": [1.0]}, "original_max_position_embeddings"),
        (
            {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
             "original_max_position_embeddings": 64},
            "short_factor has 1 entries",
        ),
        ({"rope_type": "yarn"}, "missing 'factor'"),
        ({"rope_type": "mystery"}, "'mystery'"),
    ],
)  # fmt: skip
def test_bad_rope_settings_are_named(rope, match):
    hf = dict(
        architectures=["Phi3ForCausalLM"], vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        rope_scaling=rope,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(hf)
