"""Time the MoE expert MLP (``jbatch.models.moe.expert_outputs``) per implementation.

``blocks`` (the default), ``ragged_dot`` (``jax.lax.ragged_dot``) and ``dense`` (every expert
on every token, the O(tokens x experts) baseline) on the flat token buffer of one layer, for a
Mixtral-like shape (8 experts, top-2) and a Qwen3-MoE-like one (64 experts, top-8), both with
the hidden/intermediate sizes scaled down to fit a CPU run. Prints one JSON line per case.

    PYTHONPATH=. python scripts/bench_moe.py [--tokens 8,32,256] [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jbatch.models import moe

# name -> (hidden, intermediate, experts, top-k)
SHAPES = {"mixtral_like": (1024, 3584, 8, 2), "qwen3_moe_like": (1024, 384, 64, 8)}


def dense(x, weights, ids, valid, w_gate, w_up, w_down):
    h = jax.nn.silu(jnp.einsum("te,nef->tnf", x, w_gate)) * jnp.einsum("te,nef->tnf", x, w_up)
    y = jnp.einsum("tnf,nfe->tne", h, w_down)
    picked = jnp.take_along_axis(y, ids[:, :, None], axis=1)
    return jnp.where(valid[:, None], jnp.einsum("tk,tke->te", weights, picked), 0)


def timed(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="8,32,256")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.RandomState(0)
    for name, (e, f, n, k) in SHAPES.items():
        w_gate, w_up = (jnp.asarray(rng.randn(n, e, f) * 0.02, jnp.float32) for _ in range(2))
        w_down = jnp.asarray(rng.randn(n, f, e) * 0.02, jnp.float32)
        router = jnp.asarray(rng.randn(e, n), jnp.float32)
        for t in map(int, args.tokens.split(",")):
            x = jnp.asarray(rng.randn(t, e), jnp.float32)
            weights, ids = jax.lax.top_k(jax.nn.softmax(x @ router, -1), k)
            valid = jnp.ones(t, bool)
            inputs = (x, weights, ids, valid, w_gate, w_up, w_down)
            ms = {}
            for impl in moe.IMPLS:
                fn = jax.jit(lambda *a, impl=impl: moe.expert_outputs(*a, impl=impl))
                ms[impl] = round(timed(fn, inputs, args.iters), 2)
            ms["dense"] = round(timed(jax.jit(dense), inputs, args.iters), 2)
            case = dict(shape=name, tokens=t, hidden=e, intermediate=f, experts=n, top_k=k)
            print(json.dumps({**case, "ms": ms, "backend": jax.default_backend()}), flush=True)


if __name__ == "__main__":
    main()
