"""KV cache quantization: pool bytes per token, and the XLA attention path's time per call on an
8-bit pool vs a float one.

    PYTHONPATH=. python scripts/bench_kv_quant.py --out docs/bench_kv_quant.json

Bytes per token are exact (the pool's arrays, scales included, summed over layers). Timing: the
XLA paged attention path (``paged_attention(impl="xla")``, one layer) on the same batch with a
float32, bfloat16, int8 and float8_e4m3 pool; the implementations are timed round-robin (each
round calls every one once) so a load change on a shared machine hits them alike; the median
per call is reported.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jbatch.models.config import ModelConfig
from jbatch.models.kv_cache import KVCache, bytes_per_token
from pallas_kernels import paged_attention
from pallas_kernels.kv_quant import quantize

# name -> (layers, KV heads, head dim)
MODEL_SHAPES = {
    "demo model": (4, 2, 32),
    "SmolLM2-135M": (30, 3, 64),
    "Llama-3-8B": (32, 8, 128),
}
POOLS = ("float32", "bfloat16", "int8", "float8_e4m3fn")


def bytes_table() -> list[dict]:
    rows = []
    for name, (layers, kvh, d) in MODEL_SHAPES.items():
        cfg = ModelConfig("llama", 1024, kvh * d, 4 * kvh * d, layers, kvh, kvh, d)
        pool = lambda p, cfg=cfg: jax.eval_shape(functools.partial(KVCache.zeros, cfg, 64, 16, p))
        per = {p: bytes_per_token(pool(p)) for p in POOLS}
        rows.append(dict(model=name, layers=layers, kv_heads=kvh, head_dim=d, bytes=per))
    return rows


def attention_case(rng, *, rows: int, ctx: int, bq: int, h: int, kvh: int, d: int, ps: int):
    """``rows`` blocks of ``bq`` query rows, each the last ``bq`` tokens of a ``ctx`` context."""
    mp = -(-ctx // ps)
    num_pages = rows * mp + 1
    tables = rng.permutation(num_pages)[: rows * mp].reshape(rows, mp).astype(np.int32)
    pos = (ctx - bq + np.arange(bq))[None].repeat(rows, 0).astype(np.int32)
    k = rng.standard_normal((num_pages, ps, kvh, d), np.float32)
    v = rng.standard_normal((num_pages, ps, kvh, d), np.float32)
    q = rng.standard_normal((rows, bq, h, d), np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), jnp.asarray(pos)


def time_pools(case: dict, reps: int) -> dict[str, float]:
    q, k, v, tables, pos = attention_case(np.random.default_rng(0), **case)
    fns = {}
    for pool in POOLS:
        if pool in ("int8", "float8_e4m3fn"):
            (kq, ks), (vq, vs) = quantize(k, pool), quantize(v, pool)
            arrays = (kq, vq, ks, vs)
        else:
            arrays = (k.astype(pool), v.astype(pool), None, None)
        fn = jax.jit(
            lambda q, kp, vp, ks, vs: paged_attention(
                q, kp, vp, tables, pos, impl="xla", k_scales=ks, v_scales=vs
            )
        )
        jax.block_until_ready(fn(q, *arrays))  # compile
        fns[pool] = (fn, arrays)
    times: dict[str, list[float]] = {p: [] for p in POOLS}
    for _ in range(reps):
        for pool, (fn, arrays) in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(q, *arrays))
            times[pool].append(time.perf_counter() - t)
    return {p: float(np.median(t)) * 1e3 for p, t in times.items()}


CASES = {  # SmolLM2-135M attention (9 q heads, 3 KV heads, head dim 64), page size 16
    "decode 32 x ctx 512": dict(rows=32, ctx=512, bq=1),
    "decode 32 x ctx 2048": dict(rows=32, ctx=2048, bq=1),
    "prefill 4 x 16 rows, ctx 1024": dict(rows=4, ctx=1024, bq=16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shape = dict(h=9, kvh=3, d=64, ps=16)
    timing = []
    for name, case in CASES.items():
        ms = time_pools({**case, **shape}, args.reps)
        timing.append(dict(case=name, **case, ms=ms))
        print(name, {p: f"{t:.2f} ms" for p, t in ms.items()}, flush=True)
    sizes = bytes_table()
    for r in sizes:
        b = r["bytes"]
        print(
            f"{r['model']}: " + ", ".join(f"{p} {b[p]:.0f} B" for p in POOLS)
            + f"; int8 holds {b['bfloat16'] / b['int8']:.2f}x a bf16 pool's tokens"
        )  # fmt: skip
    report = dict(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0]}",
        jax=jax.__version__,
        attention_shape=shape,
        reps=args.reps,
        timing=timing,
        bytes_per_token=sizes,
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
