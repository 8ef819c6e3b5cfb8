"""Multi-host (multi-process) JAX: ``jax.distributed.initialize`` wiring for the CLI and tests.

Every process of a multi-host run calls :func:`initialize` before touching JAX's devices; then
``jax.devices()`` lists every process's devices, a mesh spans them all, and each process loads
and holds only its own devices' shards (see ``docs/scaling.md`` for the launch recipe). JAX is
multi-controller: every process must run the same programs in the same order, so every process
drives the same engine with the same requests (``jbatch generate`` with identical arguments).
"""

from __future__ import annotations

import jax


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Join a multi-process JAX run; with no arguments JAX auto-detects the cluster (TPU pod
    slices, SLURM, Open MPI). On CPU, cross-process collectives use gloo."""
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, {num_processes})")
    if jax.config.jax_platforms in ("cpu",) or not jax.config.jax_platforms:
        # Only matters on CPU backends; must be set before the backend starts.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
