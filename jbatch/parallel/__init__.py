"""Tensor and data parallelism on XLA SPMD: meshes, sharding rules, sharded loading, replicas.

See ``docs/scaling.md``. ``EngineConfig(tp=..., dp=...)`` (CLI ``--tp N --dp M``) is all a user
needs; these are the pieces :class:`jbatch.LLM` assembles.
"""

from jbatch.parallel.engines import build_engine, build_engines
from jbatch.parallel.loading import load_params_sharded
from jbatch.parallel.mesh import (
    check_fits,
    kv_replication,
    make_mesh,
    replica_meshes,
    sharded_model_config,
)
from jbatch.parallel.router import ReplicaRouter
from jbatch.parallel.sharding import (
    KV_POOL_SPEC,
    param_shardings,
    param_specs,
    shard_params,
    state_shardings,
)

__all__ = [
    "KV_POOL_SPEC",
    "ReplicaRouter",
    "build_engine",
    "build_engines",
    "check_fits",
    "kv_replication",
    "load_params_sharded",
    "make_mesh",
    "param_shardings",
    "param_specs",
    "replica_meshes",
    "shard_params",
    "sharded_model_config",
    "state_shardings",
]
