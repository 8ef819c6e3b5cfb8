"""Mixture-of-experts fields of :class:`jbatch.models.config.ModelConfig`: parsed from an HF
``config.json`` (Mixtral, Qwen3-MoE), validated, and the per-layer layout they imply.

Which layers are sparse: Mixtral routes every layer's MLP. Qwen3-MoE routes layer ``i`` when
``i`` is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; the other layers
keep a dense MLP of ``intermediate_size`` (the experts have ``moe_intermediate_size``).
"""

from __future__ import annotations

from typing import Any

MOE_FAMILIES = frozenset({"mixtral", "qwen3_moe"})
# The params groups of a MoE model besides "layers" (see mlp_groups).
DENSE_MLP, MOE = "dense_mlp", "moe"
MLP_GROUPS = (DENSE_MLP, MOE)


def _error(message: str) -> Exception:
    from jbatch.models.config import ConfigError  # config.py imports this module

    return ConfigError(message)


def moe_fields(hf: dict[str, Any], model_type: str, num_layers: int, source: str) -> dict:
    """The ModelConfig keyword arguments of the MoE fields ({} for a dense family)."""
    if model_type not in MOE_FAMILIES:
        return {}
    # Mixtral and transformers 5 write num_local_experts; Hub Qwen3-MoE configs num_experts.
    num_experts = hf.get("num_local_experts", hf.get("num_experts"))
    if num_experts is None:
        raise _error(f"{source}: missing required field 'num_local_experts' (or 'num_experts')")
    if "num_experts_per_tok" not in hf:
        raise _error(f"{source}: missing required field 'num_experts_per_tok'")
    if model_type == "mixtral":
        return dict(
            num_experts=int(num_experts),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            moe_layers=(True,) * num_layers,
        )
    if "moe_intermediate_size" not in hf:
        raise _error(f"{source}: missing required field 'moe_intermediate_size'")
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise _error(f"{source}: decoder_sparse_step must be a positive int, got {step!r}")
    dense = hf.get("mlp_only_layers") or []
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise _error(
            f"{source}: mlp_only_layers={dense} has entries outside the layers 0..{num_layers - 1}"
        )
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=tuple(
            int(num_experts) > 0 and i not in dense and (i + 1) % step == 0
            for i in range(num_layers)
        ),
    )


def check_moe(cfg) -> None:
    """Validate (and default) the MoE fields of a ModelConfig; raises ConfigError naming one."""
    if not cfg.moe_layers:
        object.__setattr__(cfg, "moe_layers", (cfg.num_experts > 0,) * cfg.num_layers)
    if len(cfg.moe_layers) != cfg.num_layers:
        raise _error(
            f"moe_layers has {len(cfg.moe_layers)} entries, expected num_layers={cfg.num_layers}"
        )
    if cfg.num_experts < 0:
        raise _error(f"num_experts must be >= 0, got {cfg.num_experts}")
    if cfg.num_experts == 0:
        if any(cfg.moe_layers):
            raise _error("moe_layers marks sparse layers but num_experts=0")
        return
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise _error(
            f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_experts="
            f"{cfg.num_experts}"
        )
    if cfg.moe_intermediate_size <= 0:
        raise _error(f"moe_intermediate_size must be > 0, got {cfg.moe_intermediate_size}")


def mlp_groups(cfg) -> dict[str, tuple[int, ...]]:
    """MoE models: params group -> the layers it stacks, in order (each group's arrays have a
    leading axis over exactly those layers). ``"moe"``: the routed layers' router and experts;
    ``"dense_mlp"``: the dense layers' MLP. Empty groups are left out. Dense models: ``{}``
    (their MLP weights stay in ``params["layers"]``)."""
    if cfg.num_experts == 0:
        return {}
    groups = {
        name: tuple(i for i, sparse in enumerate(cfg.moe_layers) if sparse == (name == MOE))
        for name in MLP_GROUPS
    }
    return {name: ids for name, ids in groups.items() if ids}


def group_of_layer(cfg, layer: int) -> tuple[str, int] | None:
    """``(group, index in that group)`` of layer ``layer``'s MLP params; None for dense models."""
    for name, ids in mlp_groups(cfg).items():
        if layer in ids:
            return name, ids.index(layer)
    return None
