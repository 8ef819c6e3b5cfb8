"""Mixture-of-experts under tensor parallelism: every expert's intermediate dimension is split
over ``tp`` (tensor parallel inside each expert, not expert parallel; docs/architecture.md,
"Mixture of experts", says why).

Tokens, routing weights and expert ids are replicated (every shard routes the same way, a few
small ops); each shard runs :func:`jbatch.models.moe.expert_outputs` unchanged on its slice of
every expert (``expert_gate``/``expert_up`` split on their output F axis, ``expert_down`` on its
input F axis), which yields a partial sum of the layer's output, and one ``psum`` adds them —
the same single all-reduce per layer as the dense MLP's row-parallel ``w_down``. The grouped
matmul's while loop runs inside ``shard_map``, so no collective ever lands inside the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jbatch.models import moe
from jbatch.parallel.sharding import TP


def sharded_experts(mesh: Mesh) -> Callable:
    """A drop-in for ``moe.expert_outputs`` (``forward(..., experts=...)``) that runs it per
    shard of ``mesh``'s ``tp`` axis."""
    tp = mesh.shape[TP]

    def run(x, weights, ids, valid, w_gate, w_up, w_down, impl="blocks"):
        if w_gate.shape[-1] % tp:  # the sharding rules left the experts replicated
            return moe.expert_outputs(x, weights, ids, valid, w_gate, w_up, w_down, impl)

        def local(x, weights, ids, valid, w_gate, w_up, w_down):
            partial = moe.expert_outputs(x, weights, ids, valid, w_gate, w_up, w_down, impl)
            return jax.lax.psum(partial, TP)

        split_out, split_in = P(None, None, TP), P(None, TP, None)
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P(), P(), split_out, split_out, split_in),
            out_specs=P(),
            check_vma=False,
        )
        return fn(x, weights, ids, valid, w_gate, w_up, w_down)

    return run
