"""ModelConfig: the static shape of a Llama-family model, read from a Hugging Face ``config.json``.

Everything here is a Python value (never traced): it parameterises the jitted forward pass.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jbatch.models.moe_config import check_moe, moe_fields
from jbatch.models.rope import Rope, RopeError, parse_rope

# HF `architectures` entry -> the family name used in this package.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model, from `text_config`
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_MODEL_TYPES = frozenset(SUPPORTED_ARCHITECTURES.values()) | {"gemma3_text"}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA_FAMILIES = ("gemma2", "gemma3")

_REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


class ConfigError(ValueError):
    """A config.json that jbatch cannot serve; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder of one of the supported families.

    The families share one forward pass (``jbatch.models.llama``); what differs between them is
    a handful of switches here, each named after what it does rather than after the family:
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    # One RoPE per layer (Gemma 3: local layers differ from global ones); () = default RoPE.
    ropes: tuple[Rope, ...] = ()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v/o (Llama's `attention_bias`)
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2)
    mlp_bias: bool = False
    # Per-layer sliding window (None = full attention), a tuple so the config stays hashable.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # GLU activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w), in float32 (Gemma: 1)
    sandwich_norms: bool = False  # also normalise attention and MLP outputs (Gemma 2/3)
    embed_multiplier: float = 1.0  # embeddings scaled by this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    attn_soft_cap: float | None = None  # cap * tanh(score / cap) (Gemma 2)
    final_soft_cap: float | None = None  # the same on the logits (Gemma 2)
    # Mixture of experts (jbatch.models.moe_config); num_experts == 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: is its MLP the routed experts

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act={self.hidden_act!r} is not supported (supported: "
                f"{', '.join(ACTIVATIONS)})"
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type={self.model_type!r} is not supported")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} must be a positive multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even number, got {self.head_dim}")
        for name, default in (("sliding_windows", None), ("ropes", Rope())):
            value = getattr(self, name) or (default,) * self.num_layers
            if len(value) != self.num_layers:
                raise ConfigError(
                    f"{name} has {len(value)} entries, expected num_layers={self.num_layers}"
                )
            object.__setattr__(self, name, tuple(value))
        for rope in self.ropes:
            if rope.rotary_dim > self.head_dim:
                raise ConfigError(
                    f"rotary dimension {rope.rotary_dim} exceeds head_dim={self.head_dim}"
                )
        for name in ("attn_soft_cap", "final_soft_cap", "attn_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 (or absent), got {value}")
        check_moe(self)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias or self.qkv_bias

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from the parsed contents of an HF config.json; errors name ``source``."""
        model_type = _model_type(hf, source)
        if "text_config" in hf and model_type == "gemma3":  # a multimodal folder's text model
            hf = {**hf["text_config"], "architectures": ["Gemma3ForCausalLM"]}
            source = f"{source} (text_config)"
        missing = [f for f in _REQUIRED_FIELDS if f not in hf]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        num_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        num_layers = int(hf["num_hidden_layers"])
        gemma = model_type in GEMMA_FAMILIES
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            ropes=_ropes(hf, model_type, head_dim, num_layers, source),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            attention_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
            qkv_bias=model_type == "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(hf, model_type, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
            hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act", "silu")),
            qk_norm=model_type in ("qwen3", "gemma3", "qwen3_moe"),
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embed_multiplier=math.sqrt(int(hf["hidden_size"])) if gemma else 1.0,
            attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5 if gemma else None,
            attn_soft_cap=_opt_float(hf.get("attn_logit_softcapping")) if gemma else None,
            final_soft_cap=_opt_float(hf.get("final_logit_softcapping")) if gemma else None,
            **moe_fields(hf, model_type, num_layers, source),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: config.json not found")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf_dict(hf, source=str(path))


def _model_type(hf: dict[str, Any], source: str) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if archs:
        raise ConfigError(
            f"{source}: architectures={archs} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    model_type = hf.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: missing required field 'architectures' (or 'model_type')")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    return "gemma3" if model_type == "gemma3_text" else model_type


def _layer_types(hf: dict[str, Any], model_type: str, num_layers: int) -> list[str]:
    """ "sliding_attention" / "full_attention" per layer: ``layer_types`` where the config has it
    (transformers >= 4.5x writes it), else each family's older rule."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    if model_type == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if model_type == "gemma3":
        pattern = int(hf.get("sliding_window_pattern", 6))
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if model_type == "mistral":
        return ["sliding_attention"] * num_layers
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        first = int(hf.get("max_window_layers", num_layers))  # windows from this layer on
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["full_attention"] * num_layers


def _sliding_windows(hf: dict[str, Any], model_type: str, num_layers: int):
    window = hf.get("sliding_window")
    if model_type == "qwen3_moe" and not hf.get("use_sliding_window"):
        return (None,) * num_layers
    # These families window every layer when `sliding_window` is set (Phi-3-mini: 2047).
    if model_type in ("mistral", "mixtral", "qwen3_moe", "phi3") and not hf.get("layer_types"):
        return (window,) * num_layers
    types = _layer_types(hf, model_type, num_layers)
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries, expected {num_layers}")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


def _ropes(hf: dict[str, Any], model_type: str, head_dim: int, num_layers: int, source: str):
    """One :class:`Rope` per layer from ``rope_parameters`` (transformers >= 5; per layer type
    for Gemma 3) or the older ``rope_scaling`` + ``rope_theta`` (+ Gemma 3's
    ``rope_local_base_freq`` for its sliding layers)."""
    params = hf.get("rope_parameters") or {}
    try:
        if model_type == "gemma3":
            return _gemma3_ropes(hf, params, head_dim, num_layers, source)
        merged = {**params, **(hf.get("rope_scaling") or {})}
        return (parse_rope(merged, hf, head_dim, source),) * num_layers
    except RopeError as e:
        raise ConfigError(str(e)) from e


def _gemma3_ropes(hf, params, head_dim: int, num_layers: int, source: str):
    """Gemma 3: sliding layers rotate with their own base and no scaling, global layers with
    ``rope_theta`` and ``rope_scaling``."""
    if "full_attention" in params or "sliding_attention" in params:  # transformers >= 5
        full = {"rope_theta": 1e6, **(params.get("full_attention") or {})}
        local = {"rope_theta": 1e4, **(params.get("sliding_attention") or {})}
    else:
        full = {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
        local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    by_type = {
        "full_attention": parse_rope(full, hf, head_dim, source),
        "sliding_attention": parse_rope(local, hf, head_dim, source),
    }
    return tuple(by_type[t] for t in _layer_types(hf, "gemma3", num_layers))


def _opt_float(value) -> float | None:
    return None if value is None else float(value)


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
