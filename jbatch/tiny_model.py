"""Write a small random-weight Llama checkpoint in Hugging Face format (no torch needed).

Used by the README's first command, the benchmarks and the notebooks until a trained demo model
ships. The weights are random, so generated text is gibberish — but every file is the real
format (config.json, model.safetensors, generation_config.json, tokenizer.json) and
transformers loads it too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

_CORPUS_MODULES = ("textwrap", "string", "json.decoder", "collections", "dataclasses")


def _corpus() -> list[str]:
    """Text every Python install carries: some standard-library sources."""
    import importlib
    import inspect

    return [inspect.getsource(importlib.import_module(m)) for m in _CORPUS_MODULES]


def write_tokenizer(directory: Path, vocab_size: int, corpus: list[str] | None = None) -> None:
    """Train a byte-level BPE of ``vocab_size`` tokens (<unk>=0, <s>=1, </s>=2) on ``corpus``
    (default: some standard-library sources) and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() if corpus is None else corpus, trainer)
    tok.save(str(Path(directory) / "tokenizer.json"))
    (Path(directory) / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


def write_random_llama(
    directory: str | Path,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 256,
    intermediate_size: int = 1024,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    tokenizer: bool = True,
) -> Path:
    """Create ``directory`` holding a random Llama checkpoint; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(vocab_size, hidden_size),
        "model.norm.weight": np.ones(hidden_size, np.float32),
        "lm_head.weight": w(vocab_size, hidden_size),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "self_attn.q_proj.weight": w(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": w(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": w(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": w(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": w(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": w(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": w(hidden_size, intermediate_size),
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2)
    )
    if tokenizer:
        write_tokenizer(directory, vocab_size)
    return directory
