"""ModelConfig parsing: supported families, rope scaling, and clear errors."""

from __future__ import annotations

import json

import pytest

from jbatch.models.config import ConfigError, ModelConfig
from jbatch.models.rope import inv_freq


def rope_inv_freq(cfg):
    return list(inv_freq(cfg.ropes[0], cfg.head_dim))


BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_parses_llama_with_defaults():
    cfg = ModelConfig.from_hf_dict(BASE)
    assert (cfg.model_type, cfg.head_dim, cfg.q_per_kv) == ("llama", 16, 2)
    assert cfg.sliding_windows == (None, None)


@pytest.mark.parametrize(
    "arch,family", [("MistralForCausalLM", "mistral"), ("Qwen2ForCausalLM", "qwen2")]
)
def test_families(arch, family):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "sliding_window": 32})
    assert cfg.model_type == family
    assert cfg.qkv_bias == (family == "qwen2")
    assert cfg.sliding_windows == ((32, 32) if family == "mistral" else (None, None))


def test_qwen2_sliding_window_applies_from_max_window_layers():
    hf = {
        **BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "num_hidden_layers": 3,
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 1,
    }
    assert ModelConfig.from_hf_dict(hf).sliding_windows == (None, 16, 16)


def test_unsupported_architecture_is_named():
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="'gpt2'"):
        ModelConfig.from_hf_dict(
            {**{k: v for k, v in BASE.items() if k != "architectures"}, "model_type": "gpt2"}
        )


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_attention_heads"])
def test_missing_field_is_named(field, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in BASE.items() if k != field}))
    with pytest.raises(ConfigError, match=f"{path}.*{field}"):
        ModelConfig.from_file(path)


def test_bad_values_are_named():
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        ModelConfig.from_hf_dict({**BASE, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="'ntk-by-parts'"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "ntk-by-parts"}})
    with pytest.raises(ConfigError, match="low_freq_factor"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ConfigError, match="gelu"):
        ModelConfig.from_hf_dict({**BASE, "hidden_act": "gelu"})


def test_missing_and_invalid_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path / "config.json")


def test_linear_rope_divides_frequencies():
    plain = rope_inv_freq(ModelConfig.from_hf_dict(BASE))
    scaled = rope_inv_freq(
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 4.0}})
    )
    assert scaled == pytest.approx([f / 4 for f in plain])


def test_dtype_defaults_to_bfloat16_on_accelerators_only(monkeypatch):
    import jax

    from jbatch.engine.config import EngineConfig

    assert EngineConfig().dtype == "float32"  # CPU: tests compare with HF in float32
    for backend, want in (("gpu", "bfloat16"), ("tpu", "bfloat16"), ("cpu", "float32")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert EngineConfig().dtype == want
        assert EngineConfig(dtype="float16").dtype == "float16"  # explicit wins


def test_engine_config_hashes_once_and_like_its_fields():
    """The bucket caches key on the config: equal configs hash equal, a changed field changes
    the hash (``dataclasses.replace`` computes it afresh), and a pickled copy (another process
    hashes strings differently) recomputes it instead of carrying the cached value."""
    import dataclasses
    import pickle

    from jbatch.engine.config import EngineConfig

    a, b = EngineConfig(max_slots=8), EngineConfig(max_slots=8)
    assert a == b and hash(a) == hash(b) and a.__dict__["_hash"] == hash(a)
    c = dataclasses.replace(a, max_slots=4)
    assert c != a and hash(c) != hash(a)
    fields = tuple(getattr(a, f.name) for f in dataclasses.fields(a) if f.compare)
    assert hash(a) == hash(fields)
    copy = pickle.loads(pickle.dumps(a))
    assert "_hash" not in copy.__dict__ and copy == a and hash(copy) == hash(a)
    assert repr(copy) == repr(a) and "_hash" not in dataclasses.asdict(a)
