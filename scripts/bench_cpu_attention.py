"""Paged attention on the CPU: the native kernel (``attn_impl="cpu"``) against the chunked XLA
path, on the decode and speculative shapes the engine runs, interleaved in one process.

    python scripts/bench_cpu_attention.py --reps 30 --out docs/bench_cpu_attention
    python scripts/bench_cpu_attention.py --sharing --reps 300 \
        --out docs/bench_cpu_attention_sharing

Each case is one jitted call of one layer's attention (page size 16, scrambled page table,
float32 unless the case says otherwise), timed with ``block_until_ready``: each call pays a
dispatch (tens of microseconds) that an engine step pays once for all its layers, so the
smallest cases understate the kernel's lead. Implementations alternate call by call; the table
reports medians and the kernel/XLA ratio. Writes ``<out>.json`` and ``<out>.png``.

``--sharing``: when a kernel call should share its items with XLA's intra-op threads. Decode
rows of growing work (keys read x query heads x head dim), each timed as a chain of
``CHAIN`` dependent calls in one program (one dispatch for all), with the items shared
(``min_parallel_work=0``), done by the calling thread alone, and at the default
``MIN_PARALLEL_WORK``.
"""

from __future__ import annotations

import argparse
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

from pallas_kernels import cpu_attention, paged_attention
from pallas_kernels.kv_quant import quantize

PAGE = 16
SHAPES = {"smollm2": (9, 3, 64), "demo": (6, 2, 32)}  # query heads, KV heads, head dim
CASES = [  # (name, shape, blocks, rows per block, contexts: fixed or "lo-hi", pool dtype)
    ("smollm2 32 rows ctx 200", "smollm2", 32, 1, 200, "float32"),
    ("smollm2 32 rows ctx 20-600", "smollm2", 32, 1, "20-600", "float32"),
    ("smollm2 8 rows ctx 200", "smollm2", 8, 1, 200, "float32"),
    ("smollm2 1 row ctx 200", "smollm2", 1, 1, 200, "float32"),
    ("smollm2 1 row ctx 2000", "smollm2", 1, 1, 2000, "float32"),
    ("smollm2 spec 4x5 ctx 200", "smollm2", 4, 5, 200, "float32"),
    ("smollm2 32 rows int8 pool", "smollm2", 32, 1, 200, "int8"),
    ("smollm2 32 rows bf16 pool", "smollm2", 32, 1, 200, "bfloat16"),
    ("demo 32 rows ctx 20-600", "demo", 32, 1, "20-600", "float32"),
]


def make_args(rng, shape, blocks, bq, ctx, pool_dtype):
    h, kvh, d = SHAPES[shape]
    if isinstance(ctx, str):
        lo, hi = map(int, ctx.split("-"))
        lens = rng.integers(lo, hi + 1, blocks)
    else:
        lens = np.full(blocks, ctx)
    mp = -(-int(lens.max()) // PAGE)
    tables = rng.permutation(blocks * mp + 8).astype(np.int32)[: blocks * mp].reshape(blocks, mp)
    pos = (lens[:, None] - bq + np.arange(bq)[None]).astype(np.int32)
    pool = (blocks * mp + 8, PAGE, kvh, d)
    k, v = (jnp.asarray(rng.standard_normal(pool), jnp.float32) for _ in range(2))
    scales = {}
    if pool_dtype == "int8":
        (k, ks), (v, vs) = quantize(k, jnp.int8), quantize(v, jnp.int8)
        scales = dict(k_scales=ks, v_scales=vs)
    elif pool_dtype == "bfloat16":
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((blocks, bq, h, d)), jnp.float32)
    return (q, k, v, jnp.asarray(tables), jnp.asarray(pos)), scales


def interleaved_medians(fns: dict, args, reps: int) -> dict[str, float]:
    """Median seconds per call of each function on ``args``, called in turn ``reps`` times."""
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def bench(reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for name, shape, blocks, bq, ctx, pool_dtype in CASES:
        args, scales = make_args(rng, shape, blocks, bq, ctx, pool_dtype)
        fns = {
            impl: jax.jit(functools.partial(paged_attention, impl=impl, **scales))
            for impl in ("cpu", "xla")
        }
        outs = {impl: jax.block_until_ready(fn(*args)) for impl, fn in fns.items()}
        err = float(jnp.max(jnp.abs(outs["cpu"] - outs["xla"])))
        med = {impl: s * 1e3 for impl, s in interleaved_medians(fns, args, reps).items()}
        row = dict(case=name, cpu_ms=med["cpu"], xla_ms=med["xla"], max_abs_diff=err)
        row["ratio"] = row["cpu_ms"] / row["xla_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


CHAIN = 8
SHARING_CASES = [  # (shape, rows, context)
    (shape, n, ctx)
    for shape in ("demo", "smollm2")
    for n in (1, 4, 8, 32)
    for ctx in (32, 128, 256, 512)
]
SHARING = {"shared": 0, "alone": 2**62, "default": cpu_attention.MIN_PARALLEL_WORK}


def sharing_sweep(reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for shape, n, ctx in SHARING_CASES:
        args, _ = make_args(rng, shape, n, 1, ctx, "float32")
        h, _, d = SHAPES[shape]

        def chain(q, k, v, tables, pos, w):
            for _ in range(CHAIN):  # each call reads the last one's output: run in order
                q = cpu_attention.cpu_paged_attention(q, k, v, tables, pos, min_parallel_work=w)
            return q

        fns = {m: jax.jit(functools.partial(chain, w=w)) for m, w in SHARING.items()}
        outs = [np.asarray(fn(*args)) for fn in fns.values()]
        assert all(np.array_equal(outs[0], o) for o in outs[1:]), "sharing changed the result"
        row = dict(case=f"{shape} {n} rows ctx {ctx}", work=n * ctx * h * d)
        med = interleaved_medians(fns, args, reps)
        row.update({f"{m}_us": s * 1e6 / CHAIN for m, s in med.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sharing_table(rows: list[dict]) -> str:
    out = [
        "| case | work | shared µs | alone µs | alone / shared | default µs (takes) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        takes = "alone" if r["work"] < cpu_attention.MIN_PARALLEL_WORK else "shared"
        out.append(
            f"| {r['case']} | {r['work']} | {r['shared_us']:.1f} | {r['alone_us']:.1f} | "
            f"{r['alone_us'] / r['shared_us']:.2f}x | {r['default_us']:.1f} ({takes}) |"
        )
    return "\n".join(out)


def plot_sharing(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for shape in SHAPES:
        pts = sorted((r["work"], r["alone_us"] / r["shared_us"]) for r in rows
                     if r["case"].startswith(shape))  # fmt: skip
        ax.plot(*zip(*pts), "o-", label=f"{shape} shape")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axvline(cpu_attention.MIN_PARALLEL_WORK, color="red", ls="--", label="MIN_PARALLEL_WORK")
    ax.set_xscale("log")
    ax.set_xlabel("work per call (keys x query heads x head dim)")
    ax.set_ylabel("time alone / time shared")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict]) -> str:
    out = ["| case | kernel ms | XLA ms | kernel / XLA |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['case']} | {r['cpu_ms']:.3f} | {r['xla_ms']:.3f} | {r['ratio']:.2f}x |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [r["xla_ms"] for r in rows], 0.4, label="XLA chunked path")
    ax.barh(y + 0.2, [r["cpu_ms"] for r in rows], 0.4, label="native CPU kernel")
    ax.set_yticks(y, [r["case"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per call (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("bench_cpu_attention"))
    p.add_argument("--sharing", action="store_true", help="the thread-sharing sweep instead")
    args = p.parse_args()
    if not cpu_attention.available():
        sys.exit(f"the CPU kernel is unavailable: {cpu_attention.unavailable_reason()}")
    rows = sharing_sweep(args.reps) if args.sharing else bench(args.reps)
    report = dict(
        machine=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        jax=jax.__version__,
        reps=args.reps,
        results=rows,
    )
    if args.sharing:
        report["min_parallel_work"] = cpu_attention.MIN_PARALLEL_WORK
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    (plot_sharing if args.sharing else plot)(rows, args.out.with_suffix(".png"))
    print((sharing_table if args.sharing else table)(rows))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
