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

# HF `architectures` entry -> the family name used in this package.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_MODEL_TYPES = frozenset(SUPPORTED_ARCHITECTURES.values())
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

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
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling``); ``rope_type='default'`` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a Llama / Mistral / Qwen2 decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v/o (Llama's `attention_bias`)
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2)
    mlp_bias: bool = False
    # Per-layer sliding window (None = full attention), a tuple so the config stays hashable.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # Mixture of experts (jbatch.models.moe_config); num_experts == 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: is its MLP the routed experts

    def __post_init__(self):
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
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
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError(
                f"sliding_windows has {len(self.sliding_windows)} entries, "
                f"expected num_layers={self.num_layers}"
            )
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
        missing = [f for f in _REQUIRED_FIELDS if f not in hf]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        num_layers = int(hf["num_hidden_layers"])
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(hf)),
            rope_scaling=_rope_scaling(hf, source),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False))
            and model_type in ("llama", "qwen3_moe"),
            qkv_bias=model_type == "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(hf, model_type, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
            hidden_act=str(hf.get("hidden_act", "silu")),
            qk_norm=model_type == "qwen3_moe",
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
    return model_type


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers >= 5 may nest rope_theta inside rope_parameters.
    params = hf.get("rope_parameters") or {}
    return hf.get("rope_theta", params.get("rope_theta", 10000.0))


def _rope_scaling(hf: dict[str, Any], source: str) -> RopeScaling:
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "default":
        return RopeScaling()
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if "factor" not in rs:
        raise ConfigError(f"{source}: rope_scaling of type {rope_type!r} is missing 'factor'")
    kwargs: dict[str, Any] = {"rope_type": rope_type, "factor": float(rs["factor"])}
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in rs:
                raise ConfigError(f"{source}: rope_scaling of type 'llama3' is missing {key!r}")
            kwargs[key] = type(getattr(RopeScaling, key))(rs[key])
    return RopeScaling(**kwargs)


def _sliding_windows(hf: dict[str, Any], model_type: str, num_layers: int):
    window = hf.get("sliding_window")
    if model_type == "qwen3_moe" and not hf.get("use_sliding_window"):
        return (None,) * num_layers
    if model_type in ("mistral", "mixtral", "qwen3_moe"):
        return (window,) * num_layers
    if model_type == "qwen2" and hf.get("use_sliding_window") and window:
        # Qwen2 applies the window only to layers at or above max_window_layers.
        first = int(hf.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse RoPE frequencies after scaling, computed as HF transformers does (host side)."""
    dim = cfg.head_dim
    inv = [1.0 / (cfg.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        return [f / rs.factor for f in inv]
    if rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rs.factor)
            else:
                smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                    rs.high_freq_factor - rs.low_freq_factor
                )
                out.append((1 - smooth) * f / rs.factor + smooth * f)
        return out
    return inv
