"""Tiny random-weight HF checkpoints (saved with ``save_pretrained``) used as the test oracle."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from jbatch.tiny_model import write_tokenizer

_BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, model class, config overrides)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=1,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama_linear_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_scaling=dict(rope_type="linear", factor=2.0), attention_bias=True),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12, head_dim=32)),
    # q/k norm, an explicit head_dim != hidden/heads, YaRN scaling.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=32,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=8.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # Sandwich norms, GeGLU, query_pre_attn_scalar != head_dim, both soft caps, sliding layers
    # alternating with global ones (window shorter than the prompts).
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            attn_logit_softcapping=3.0, final_logit_softcapping=5.0, pad_token_id=0,
        ),
    ),
    # Gemma 2's layout plus q/k norm and per-layer-type RoPE: local layers on their own base,
    # the global layer with linear scaling.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1000000.0),
            ),
            pad_token_id=0,
        ),
    ),
    # Fused qkv/gate_up, partial rotary, a window on every layer, LongRoPE (sequences here stay
    # inside the original window, where HF uses the short factors; tests/test_rope.py checks the
    # long ones).
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            max_position_embeddings=512, original_max_position_embeddings=256, pad_token_id=0,
            sliding_window=24,
            rope_parameters=dict(
                rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                short_factor=[1.0, 1.3, 1.9, 2.5], long_factor=[1.1, 2.0, 4.0, 8.0],
                original_max_position_embeddings=256,
            ),
        ),
    ),
}  # fmt: skip

# Mixtures of experts (tests/test_moe.py): Mixtral, 8 experts top-2 on every layer and a sliding
# window; Qwen3-MoE, 6 experts top-2 without renormalisation, q/k norms, 3 layers of which layer
# 1 is dense (mlp_only_layers).
MOE_VARIANTS = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=24),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            num_hidden_layers=3,
            head_dim=16,
        ),
    ),
}

# Variants for tensor-parallel tests (8 query heads, so tp in {1, 2, 4, 8} divides them): KV
# heads replicated over shards (llama: 2 KV heads), split then replicated at tp=8 (qwen2: 4, with
# q/k/v biases and tied embeddings), always split (mistral: 8, sliding window).
PARALLEL_VARIANTS = {
    "llama_tp": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=8)),
    "qwen2_tp": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=4),
    ),
    "mistral_tp": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            sliding_window=6,
            num_attention_heads=8,
            num_key_value_heads=8,
            num_hidden_layers=1,
            head_dim=16,
        ),
    ),
    # Soft caps and sandwich norms under shard_map; Phi-3's fused projections split per shard.
    "gemma2_tp": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            pad_token_id=0,
        ),
    ),
    "phi3_tp": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=1, pad_token_id=0),
    ),
}


CORPUS = (
    "The quick brown fox jumps over the lazy dog. Continuous batching keeps every slot busy. "
    "Pages of keys and values live in a pool; a page table maps positions to pages. "
    "héllo wörld, naïve café, 你好世界, emoji 🙂🚀 and numbers 0123456789. "
) * 20


def save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on CORPUS, with <unk>=0, <s>=1, </s>=2."""
    write_tokenizer(Path(directory), vocab_size, [CORPUS])


def make_checkpoint(name: str, directory: Path, seed: int = 0):
    """Save a random-weight model of variant ``name`` into ``directory``; return the torch model."""
    cfg_cls, model_cls, overrides = {**VARIANTS, **PARALLEL_VARIANTS, **MOE_VARIANTS}[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**_BASE, **overrides})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    # Random init has tiny weights; scale up so logits are not all near-tied.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(directory)
    save_tokenizer(directory, cfg.vocab_size)
    return model
