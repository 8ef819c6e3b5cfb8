"""What converting the compact K/V pool to JAX's TPU kernel layout would cost per layer and step
(the alternative to storing that layout; docs/architecture.md, "TPU attention").

    PYTHONPATH=. python scripts/bench_tpu_layout.py [--pages 2048] [--kv-heads 3] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from pallas_kernels.tpu_layout import TpuPoolLayout, interleave


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dtype = jnp.bfloat16
    lay = TpuPoolLayout.of(args.kv_heads, args.head_dim, dtype)
    k = jnp.zeros((args.pages, args.page_size, args.kv_heads, args.head_dim), dtype)
    v = jnp.zeros_like(k)
    convert = jax.jit(lambda k, v: interleave(k, v, lay))
    kv = jax.block_until_ready(convert(k, v))
    t0 = time.perf_counter()
    for _ in range(args.reps):
        jax.block_until_ready(convert(k, v))
    ms = (time.perf_counter() - t0) / args.reps * 1e3
    mib = lambda a: a.nbytes / 2**20
    print(
        f"{jax.default_backend()}: compact K+V {2 * mib(k):.1f} MiB/layer -> TPU layout "
        f"{mib(kv):.1f} MiB/layer ({lay.padding_factor:.2f}x); converting: {ms:.1f} ms/layer"
    )


if __name__ == "__main__":
    main()
