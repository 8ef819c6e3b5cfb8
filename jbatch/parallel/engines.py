"""Build sharded engines: one :class:`LLMEngine` per data-parallel replica, each over its own
``(1, tp)`` sub-mesh, behind a :class:`ReplicaRouter` when ``dp > 1``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from jbatch.converted import load_weights
from jbatch.engine.config import EngineConfig
from jbatch.engine.engine_core import EngineCore
from jbatch.engine.llm_engine import LLMEngine
from jbatch.engine.sizing import resolve
from jbatch.models.config import ModelConfig
from jbatch.models.quant import ensure_quantized
from jbatch.parallel.mesh import kv_replication, make_mesh, replica_meshes, sharded_model_config
from jbatch.parallel.router import ReplicaRouter
from jbatch.parallel.sharding import shard_params
from jbatch.tokenizer import Tokenizer


def build_engines(
    model_cfg: ModelConfig,
    cfg: EngineConfig,
    *,
    model_dir: str | Path | None = None,
    params: dict | None = None,
    tokenizer: Tokenizer | None = None,
    eos_token_ids: Seq[int] = (),
    warmup: bool = True,
    devices=None,
) -> list[LLMEngine]:
    """``cfg.dp`` engines over ``cfg.tp`` devices each (``devices``: default all devices).

    Params come from ``model_dir`` (sharded loading: each device reads only its own slices) or,
    for models already in memory, from ``params`` (placed with ``jax.device_put``). Raises
    ``ValueError`` when the mesh does not fit the devices or the model's heads.
    """
    if (model_dir is None) == (params is None):
        raise ValueError("pass exactly one of model_dir and params")
    kv_replication(model_cfg, cfg.tp)  # heads before devices: the more useful error first
    cfg = resolve(cfg, model_cfg)  # sizes from the checkpoint's config, before sharding it
    mesh = make_mesh(cfg.tp, cfg.dp, devices)
    scfg = sharded_model_config(model_cfg, cfg.tp)
    engines = []
    for sub in replica_meshes(mesh):
        if model_dir is not None:
            sharded = load_weights(model_dir, model_cfg, cfg, sub)  # HF or converted folder
        else:
            sharded = shard_params(ensure_quantized(params, cfg.weight_quant), model_cfg, sub)
        core = EngineCore(scfg, cfg, sub)
        engines.append(LLMEngine(scfg, sharded, cfg, tokenizer, eos_token_ids, warmup, core=core))
    return engines


def build_engine(model_cfg: ModelConfig, cfg: EngineConfig, **kwargs) -> LLMEngine | ReplicaRouter:
    """:func:`build_engines`, as one engine (``dp == 1``) or a router over the replicas."""
    engines = build_engines(model_cfg, cfg, **kwargs)
    return engines[0] if len(engines) == 1 else ReplicaRouter(engines)
