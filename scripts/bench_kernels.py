"""Paged attention kernels at Llama-3-8B shapes: our ragged Pallas kernel vs the XLA paths and
JAX's own Pallas GPU ``paged_attention`` (decode only), as a fraction of copy bandwidth.

    python scripts/bench_kernels.py --out bench_kernels.json     # on a GPU (scripts/gpu_check.sh)
    python scripts/bench_kernels.py --smoke                      # tiny sizes, interpret mode, CPU

Shapes: 32 query heads, 8 KV heads, head dim 128, bf16, page size 16. Decode cases: B sequences
of context C, one query row each; the mixed case adds prompt chunks to a decode batch. Bandwidth
= K/V bytes the attention must read (sum of contexts x KVH x D x 2 x 2 bytes) / median time;
"copy" = a device-to-device array copy (read + write) of the same order of size.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.paged_attention_xla import paged_attention_xla


def timeit(fn, *args, reps: int) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def copy_bandwidth(nbytes: int, reps: int) -> float:
    x = jnp.arange(nbytes // 4, dtype=jnp.float32)
    t = timeit(jax.jit(lambda a: a + 1.0), x, reps=reps)  # reads and writes nbytes
    return 2 * nbytes / t


def make_case(rng, *, decode: int, ctx: int, chunks: int, chunk_len: int, shape: dict):
    """Decode rows then prompt chunks (each chunk: the last chunk_len tokens of a ctx context)."""
    h, kvh, d, ps, dtype = shape["h"], shape["kvh"], shape["d"], shape["page_size"], shape["dtype"]
    s = decode + chunks
    mp = -(-ctx // ps)
    num_pages = s * mp
    tables = rng.permutation(num_pages).reshape(s, mp).astype(np.int32)
    qlen = np.array([1] * decode + [chunk_len] * chunks, np.int32)
    qs = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    key = jax.random.key(0)
    kk, kv, kq = jax.random.split(key, 3)
    pool = (num_pages, ps, kvh, d)
    k = jax.random.normal(kk, pool, dtype)
    v = jax.random.normal(kv, pool, dtype)
    q = jax.random.normal(kq, (int(qs[-1]), h, d), dtype)
    seq_lens = np.full(s, ctx, np.int32)
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(qs))
    kv_bytes = s * ctx * kvh * d * 2 * jnp.dtype(dtype).itemsize
    return args, kv_bytes


def xla_rows(q, k, v, tables, seq_lens, qs):
    """The XLA path on this batch: every row its own block of one (decode-style blocks)."""
    t = q.shape[0]
    rows = jnp.arange(t)
    seq = jnp.minimum(jnp.searchsorted(qs[1:], rows, side="right"), tables.shape[0] - 1)
    pos = seq_lens[seq] - (qs[seq + 1] - qs[seq]) + rows - qs[seq]
    return paged_attention_xla(q[:, None], k, v, tables[seq], pos[:, None])[:, 0]


def bench(args) -> dict:
    interpret = args.smoke
    if args.smoke:
        shape = dict(h=8, kvh=2, d=64, page_size=16, dtype=jnp.bfloat16)
        decode_cases = [(4, 64), (2, 128)]
        mixed = dict(decode=3, ctx=64, chunks=1, chunk_len=16)
        copy_bytes = 1 << 22
    else:
        shape = dict(h=32, kvh=8, d=128, page_size=16, dtype=jnp.bfloat16)
        decode_cases = [(64, 1024), (64, 8192), (256, 1024), (256, 4096), (256, 8192)]
        mixed = dict(decode=64, ctx=2048, chunks=4, chunk_len=512)
        copy_bytes = 1 << 31
    rng = np.random.default_rng(0)
    copy_bw = copy_bandwidth(copy_bytes, args.reps)
    impls = {
        "ragged_pallas": jax.jit(
            lambda *a: ragged_paged_attention(*a, max_query_len=1, interpret=interpret)
        ),
        "xla": jax.jit(xla_rows),
        "reference": jax.jit(ragged_paged_attention_reference),
    }
    rows = []
    cases = [dict(decode=b, ctx=c, chunks=0, chunk_len=0) for b, c in decode_cases] + [mixed]
    for case in cases:
        a, kv_bytes = make_case(rng, **case, shape=shape)
        fns = dict(impls)
        if case["chunks"]:
            fns["ragged_pallas"] = jax.jit(
                lambda *x, n=case["chunk_len"]: ragged_paged_attention(
                    *x, max_query_len=n, interpret=interpret
                )
            )
        else:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

            kvh_first = (a[1].transpose(2, 0, 1, 3), a[2].transpose(2, 0, 1, 3))  # [KVH, P, S, D]
            jax_args = (a[0], *kvh_first, a[3], a[4])
            mp = a[3].shape[1]
            splits = max(k for k in (1, 2, 4, 8, 16) if mp % k == 0)
            fns["jax_pallas_decode"] = (
                jax.jit(lambda *x, k=splits: paged_attention(*x, k_splits=k, interpret=interpret)),
                jax_args,
            )
        for name, fn in fns.items():
            fn, fargs = fn if isinstance(fn, tuple) else (fn, a)
            row = dict(case, impl=name, kv_gb=kv_bytes / 1e9)
            try:
                t = timeit(fn, *fargs, reps=args.reps)
                row.update(ms=t * 1e3, gbps=kv_bytes / t / 1e9, frac_copy=kv_bytes / t / copy_bw)
            except Exception as e:  # OOM or unsupported size: record it, keep going
                row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return dict(
        device=str(jax.devices()[0]),
        jax=jax.__version__,
        python=platform.python_version(),
        smoke=args.smoke,
        shape={k: str(v) for k, v in shape.items()},
        copy_gbps=copy_bw / 1e9,
        results=rows,
    )


def table(report: dict) -> str:
    out = [
        f"device {report['device']}, jax {report['jax']}, copy {report['copy_gbps']:.0f} GB/s",
        "| seqs | ctx | prefill | impl | ms | KV GB/s | of copy |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        pre = f"{r['chunks']}x{r['chunk_len']}" if r["chunks"] else "-"
        head = f"| {r['decode']} | {r['ctx']} | {pre} | {r['impl']} |"
        if "error" in r:
            out.append(f"{head} error | | {r['error'][:60]} |")
        else:
            out.append(f"{head} {r['ms']:.3f} | {r['gbps']:.1f} | {r['frac_copy']:.0%} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("bench_kernels.json"))
    args = p.parse_args()
    if args.smoke:
        args.reps = min(args.reps, 2)
    report = bench(args)
    args.out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
