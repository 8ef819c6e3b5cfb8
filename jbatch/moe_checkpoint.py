"""The MLP params of mixture-of-experts checkpoints (Mixtral, Qwen3-MoE): shapes and reading.

Layout (see docs/architecture.md, "Mixture of experts"): a MoE model's MLP weights are not in
``params["layers"]`` but in one group per kind of layer (:func:`jbatch.models.moe_config.
mlp_groups`), each stacked over exactly its own layers:

* ``moe`` ``[Lm, ...]``: ``router [Lm, E, N]``, ``expert_gate``/``expert_up [Lm, N, E, F]``,
  ``expert_down [Lm, N, F, E]`` (``[in, out]`` like every linear weight; F =
  ``moe_intermediate_size``);
* ``dense_mlp`` ``[Ld, ...]`` (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``):
  ``w_gate``/``w_up [Ld, E, F]``, ``w_down [Ld, F, E]`` as in a dense model.

Two checkpoint layouts of the experts are read:

* per expert (what transformers 5.24 ``save_pretrained`` writes, and Hub checkpoints): Mixtral
  ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{j}.w1|w3|w2`` (gate|up|down),
  Qwen3-MoE ``mlp.gate`` and ``mlp.experts.{j}.gate_proj|up_proj|down_proj``, each ``[out, in]``;
* fused (transformers' in-memory modules, e.g. a ``state_dict`` saved as is): ``mlp.gate``,
  ``mlp.experts.gate_up_proj [N, 2F, E]`` (gate rows first) and ``mlp.experts.down_proj
  [N, E, F]``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jbatch.models.config import ModelConfig
from jbatch.models.moe_config import DENSE_MLP, MOE, mlp_groups

# Reads a tensor by HF name, checking its HF shape; returns an array that slices lazily.
Getter = Callable[[str, tuple[int, ...]], np.ndarray]

_DENSE_NAMES = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
# family -> (module of the per-expert layout, per-expert names of gate/up/down)
_PER_EXPERT = {
    "mixtral": ("block_sparse_moe", dict(expert_gate="w1", expert_up="w3", expert_down="w2")),
    "qwen3_moe": (
        "mlp",
        dict(expert_gate="gate_proj", expert_up="up_proj", expert_down="down_proj"),
    ),
}


def moe_param_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Shapes of the MLP groups (``{}`` for a dense model)."""
    e, n, f, fd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for group, ids in mlp_groups(cfg).items():
        lg = len(ids)
        if group == MOE:
            out[group] = {
                "router": (lg, e, n),
                "expert_gate": (lg, n, e, f),
                "expert_up": (lg, n, e, f),
                "expert_down": (lg, n, f, e),
            }
        else:
            out[group] = {"w_gate": (lg, e, fd), "w_up": (lg, e, fd), "w_down": (lg, fd, e)}
    return out


def _take(hf: np.ndarray, index: tuple, perm: tuple[int, ...]) -> np.ndarray:
    """``hf`` at ``index`` of the jbatch layout, in jbatch axis order (jbatch axis ``a`` is
    ``hf`` axis ``perm[a]``). Basic slices keep a memmap a view until the final copy."""
    out = hf
    for a, ix in enumerate(index):
        out = out[(slice(None),) * perm[a] + (ix,)]
    return np.transpose(out, perm)


def _fused(names, layer: int) -> bool:
    return f"model.layers.{layer}.mlp.experts.gate_up_proj" in names


def read_param(
    get: Getter, names, cfg: ModelConfig, group: str, key: str, layer: int, index: tuple
) -> np.ndarray:
    """Param ``group/key`` of model layer ``layer`` at ``index`` (a tuple of slices over the
    per-layer jbatch shape), read through ``get`` from a checkpoint holding tensor ``names``."""
    e, n, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    pre = f"model.layers.{layer}."
    if group == DENSE_MLP:
        fd = cfg.intermediate_size
        shape = (e, fd) if key == "w_down" else (fd, e)
        return _take(get(f"{pre}mlp.{_DENSE_NAMES[key]}.weight", shape), index, (1, 0))
    if group != MOE:
        raise ValueError(f"unknown params group {group!r}")
    fused = _fused(names, layer)
    module = "mlp" if fused else _PER_EXPERT[cfg.model_type][0]
    if key == "router":
        return _take(get(f"{pre}{module}.gate.weight", (n, e)), index, (1, 0))
    if fused:
        if key == "expert_down":
            return _take(get(f"{pre}mlp.experts.down_proj", (n, e, f)), index, (0, 2, 1))
        gate_up = get(f"{pre}mlp.experts.gate_up_proj", (n, 2 * f, e))
        half = gate_up[:, :f] if key == "expert_gate" else gate_up[:, f:]
        return _take(half, index, (0, 2, 1))
    name = _PER_EXPERT[cfg.model_type][1][key]
    shape = (e, f) if key == "expert_down" else (f, e)
    experts = range(n)[index[0]]
    parts = [
        _take(get(f"{pre}{module}.experts.{j}.{name}.weight", shape), index[1:], (1, 0))
        for j in experts
    ]
    return np.stack(parts)


def iter_groups(get: Getter, names, cfg: ModelConfig, target: np.dtype):
    """Yield ``(group, key, host array of dtype target)`` for every MLP-group param of a MoE
    model (nothing for a dense one), one param at a time."""
    groups = mlp_groups(cfg)
    for group, shapes in moe_param_shapes(cfg).items():
        for key, shape in shapes.items():
            buf = np.empty(shape, dtype=target)
            whole = (slice(None),) * (len(shape) - 1)
            for g, layer in enumerate(groups[group]):
                buf[g] = read_param(get, names, cfg, group, key, layer, whole)
            yield group, key, buf
