"""Lowering Pallas kernels for an accelerator this host does not have (CPU CI).

Mosaic TPU (every jax here) and the Triton backend (jax >= 0.11) ask for the target chip while
lowering; off that chip they read it from the abstract mesh's device, which these contexts set.
Use them around ``jax.jit(f).trace(...).lower(lowering_platforms=...)`` or ``jax.export``.
"""

from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def abstract_device(device_kind: str, platform: str):
    """Trace and lower as if the default device were a ``device_kind`` on ``platform``."""
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
    auto = (jax.sharding.AxisType.Auto,)  # newer jax defaults to Explicit: no sharding types
    mesh = jax.sharding.AbstractMesh((1,), ("_target",), auto, abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def tpu_lowering_context(device_kind: str = "TPU v5 lite"):
    """For Mosaic TPU kernels (JAX's TPU ragged paged attention)."""
    return abstract_device(device_kind, "tpu")


def gpu_lowering_context(device_kind: str = "NVIDIA H200"):
    """For Pallas Triton kernels on jax >= 0.11 (harmless on older jax)."""
    return abstract_device(device_kind, "gpu")
