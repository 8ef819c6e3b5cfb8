"""The params pytree's layout: which params a model has, their shapes, and which Hugging Face
tensor each one is read from (per family). One place for names and shapes: the host loader
(``jbatch.checkpoint``), the sharded loader (``jbatch.parallel.loading``), orbax restore and the
sharding rules all derive from it.

Layout: L layers stacked on a leading axis; HF ``[out, in]`` linear weights transposed to
``[in, out]``; the embedding and LM head kept ``[V, E]``. A mixture-of-experts model's MLP
weights live in their own groups (``jbatch.moe_checkpoint``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jbatch.models.config import ModelConfig
from jbatch.moe_checkpoint import moe_param_shapes


class CheckpointError(ValueError):
    """A checkpoint jbatch cannot load; the message names the file (and tensor) at fault."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one jbatch param comes from: an HF tensor name (under ``model.layers.{i}.`` for
    layer params), whether it is a linear weight (HF ``[out, in]``, transposed on load), and for
    a fused tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``) the slice of its output rows."""

    name: str
    linear: bool = False
    rows: tuple[int, int] | None = None  # [start, stop) of the fused tensor's out rows
    fused_out: int = 0  # out rows of the whole fused tensor

    def hf_shape(self, jb_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The file's shape of the tensor behind a param of (per-layer) shape ``jb_shape``."""
        shape = jb_shape[::-1] if self.linear else jb_shape
        return (self.fused_out, *shape[1:]) if self.rows else shape

    def take(self, tensor):
        """The param's part of the file's tensor (a view for a fused one), in HF layout."""
        return tensor[self.rows[0] : self.rows[1]] if self.rows else tensor


# jbatch layer param -> its HF tensor, for the Llama layout every family starts from.
_LAYER_TENSORS = {
    "attn_norm": Source("input_layernorm.weight"),
    "wq": Source("self_attn.q_proj.weight", True),
    "wk": Source("self_attn.k_proj.weight", True),
    "wv": Source("self_attn.v_proj.weight", True),
    "wo": Source("self_attn.o_proj.weight", True),
    "bq": Source("self_attn.q_proj.bias"),
    "bk": Source("self_attn.k_proj.bias"),
    "bv": Source("self_attn.v_proj.bias"),
    "bo": Source("self_attn.o_proj.bias"),
    "q_norm": Source("self_attn.q_norm.weight"),
    "k_norm": Source("self_attn.k_norm.weight"),
    "mlp_norm": Source("post_attention_layernorm.weight"),
    "w_gate": Source("mlp.gate_proj.weight", True),
    "w_up": Source("mlp.up_proj.weight", True),
    "w_down": Source("mlp.down_proj.weight", True),
    "b_gate": Source("mlp.gate_proj.bias"),
    "b_up": Source("mlp.up_proj.bias"),
    "b_down": Source("mlp.down_proj.bias"),
}
# Gemma 2/3 normalise four times a layer; their `post_attention_layernorm` is the norm of the
# attention *output*, and the pre-MLP norm is `pre_feedforward_layernorm`.
_SANDWICH_NORMS = {
    "post_attn_norm": Source("post_attention_layernorm.weight"),
    "mlp_norm": Source("pre_feedforward_layernorm.weight"),
    "post_mlp_norm": Source("post_feedforward_layernorm.weight"),
}
# jbatch top-level param -> its HF tensor name after the model prefix (see `weight_prefix`).
_TOP_TENSORS = {
    "embed": Source("embed_tokens.weight"),
    "final_norm": Source("norm.weight"),
    "lm_head": Source("lm_head.weight"),  # kept [V, E], like the embedding (faster LM head)
}
# Where the decoder's tensors live: causal LMs under `model.`; Gemma 3 multimodal folders keep
# the language model under `model.language_model.` (transformers 5) or `language_model.model.`.
_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def layer_sources(cfg: ModelConfig) -> dict[str, Source]:
    """The HF tensor of every layer param of ``cfg``'s family."""
    sources = dict(_LAYER_TENSORS)
    if cfg.sandwich_norms:
        sources.update(_SANDWICH_NORMS)
    if cfg.model_type == "phi3":  # fused projections, split on load
        q, kv, f = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.intermediate_size,
        )
        qkv = lambda lo, hi: Source("self_attn.qkv_proj.weight", True, (lo, hi), q + 2 * kv)
        gate_up = lambda lo, hi: Source("mlp.gate_up_proj.weight", True, (lo, hi), 2 * f)
        sources.update(
            wq=qkv(0, q), wk=qkv(q, q + kv), wv=qkv(q + kv, q + 2 * kv),
            w_gate=gate_up(0, f), w_up=gate_up(f, 2 * f),
        )  # fmt: skip
    return sources


def weight_prefix(names, where: str) -> str:
    """The prefix of the decoder's tensors among tensor ``names`` (see ``_PREFIXES``)."""
    for prefix in _PREFIXES:
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise CheckpointError(
        f"{where}: no embedding tensor found (looked for "
        f"{', '.join(p + 'embed_tokens.weight' for p in _PREFIXES)})"
    )


def top_name(key: str, prefix: str) -> str:
    """The HF name of top-level param ``key`` (the LM head sits outside the model prefix)."""
    return _TOP_TENSORS[key].name if key == "lm_head" else prefix + _TOP_TENSORS[key].name


_MLP_KEYS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def expected_param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of every param (same nesting as the params pytree), as tuples of ints."""
    L, E, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Q, KV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (L, E),
        "wq": (L, E, Q),
        "wk": (L, E, KV),
        "wv": (L, E, KV),
        "wo": (L, Q, E),
        "mlp_norm": (L, E),
        "w_gate": (L, E, F),
        "w_up": (L, E, F),
        "w_down": (L, F, E),
    }
    if cfg.has_qkv_bias:
        layers.update(bq=(L, Q), bk=(L, KV), bv=(L, KV))
    if cfg.attention_bias:
        layers["bo"] = (L, E)
    if cfg.mlp_bias:
        layers.update(b_gate=(L, F), b_up=(L, F), b_down=(L, E))
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    if cfg.sandwich_norms:
        layers.update(post_attn_norm=(L, E), post_mlp_norm=(L, E))
    groups = moe_param_shapes(cfg)  # MoE: the MLP weights live in their own groups
    if groups:
        layers = {k: v for k, v in layers.items() if k not in _MLP_KEYS}
    shapes: dict[str, Any] = {"embed": (V, E), "layers": layers, "final_norm": (E,), **groups}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, E)
    return shapes
