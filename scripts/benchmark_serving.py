"""Serving benchmark (``vllm bench serve`` style) against a running ``jbatch serve`` over gRPC.

    jbatch serve --model DIR &                      # or let the script start one: --launch DIR
    python scripts/benchmark_serving.py --target 127.0.0.1:50051 --num-prompts 200 \
        --request-rate 8 [--dataset prompts.jsonl] [--result-file out.json]
    python scripts/benchmark_serving.py --launch DIR --request-rate 2,4,8,16,inf \
        --plot docs/bench_serving.png                # a sweep, one server

Data flow:
1. Requests come from a seeded synthetic dataset (random token ids; prompt and output lengths
   drawn uniformly from the given ranges) or a local JSONL file (``{"prompt": str,
   "max_tokens": int}`` per line); ``ignore_eos`` keeps output lengths fixed.
2. Arrival times: a Poisson process at ``--request-rate`` requests/s (``inf``: all at once),
   seeded; each request is its own asyncio task on one gRPC channel.
3. Each task records when every streamed response arrives (a response may carry several tokens).
4. Metrics: request/s, output tok/s, TTFT, TPOT (mean time per output token after the first),
   ITL (gap between streamed responses), e2e latency — mean / median / p99 — and goodput
   (requests/s meeting every given SLO: ``--goodput ttft:500 tpot:50``, milliseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from jbatch import SamplingParams
from serving.client import GenerationClient, finish_reason_name


def synthetic_requests(args, vocab: int) -> list[tuple[list[int] | str, int]]:
    rng = np.random.default_rng(args.seed)
    lo, hi = args.input_len
    olo, ohi = args.output_len
    return [
        (
            rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist(),
            int(rng.integers(olo, ohi + 1)),
        )
        for _ in range(args.num_prompts)
    ]


def jsonl_requests(path: str, num: int, default_max_tokens: int) -> list[tuple[str, int]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no requests")
    for i, row in enumerate(rows):
        if not isinstance(row.get("prompt"), str):
            raise SystemExit(f"{path}: line {i + 1} has no string 'prompt' field")
    rows = (rows * (-(-num // len(rows))))[:num]
    return [(r["prompt"], int(r.get("max_tokens", default_max_tokens))) for r in rows]


async def one_request(client, prompt, max_tokens: int, start_at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sent = time.perf_counter()
    stamps, tokens, finish, error = [], 0, None, None
    try:
        async with contextlib.aclosing(client.generate(prompt, params)) as stream:
            async for resp in stream:
                if resp.token_ids:
                    stamps.append(time.perf_counter())
                    tokens += len(resp.token_ids)
                finish = finish_reason_name(resp) or finish
    except grpc.aio.AioRpcError as e:
        error = e.code().name
    return {"sent": sent - t0, "stamps": [s - sent for s in stamps], "tokens": tokens,
            "finish": finish, "error": error}  # fmt: skip


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p99": float(np.percentile(a, 99)),
    }


def metrics(results: list[dict], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r["error"] is None and r["tokens"] > 0]
    ttft = [r["stamps"][0] for r in ok]
    e2e = [r["stamps"][-1] for r in ok]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    good = 0
    for r in ok:
        t = r["stamps"]
        per_tok = (t[-1] - t[0]) / (r["tokens"] - 1) if r["tokens"] > 1 else 0.0
        good += t[0] * 1e3 <= slos.get("ttft", np.inf) and per_tok * 1e3 <= slos.get("tpot", np.inf)
    out_tokens = sum(r["tokens"] for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if r["error"]}),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "output_tokens": out_tokens,
        "goodput": good / duration if slos else None,
        "ttft_ms": _stats(ttft),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl),
        "e2e_ms": _stats(e2e),
    }


async def run_benchmark(target: str, requests, rate: float, seed: int, slos) -> dict:
    rng = np.random.default_rng(seed)
    gaps = (
        rng.exponential(1.0 / rate, len(requests)) if np.isfinite(rate) else np.zeros(len(requests))
    )
    arrivals = np.cumsum(gaps) - gaps[0]
    async with GenerationClient(target) as client:
        await client.model_info()
        t0 = time.perf_counter()
        tasks = [one_request(client, p, n, a, t0) for (p, n), a in zip(requests, arrivals)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return {"request_rate": rate, **metrics(results, duration, slos)}


def launch_server(model: str, server_args: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "jbatch.cli", "serve", "--model", model, "--grpc-port", "0"]
    cmd += ["--http-port", "0", *server_args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    target = None
    for line in proc.stderr:
        m = re.search(r"gRPC on ([\d.]+:\d+)", line)
        target = m.group(1) if m else target
        if "ready" in line:
            return proc, target
    raise RuntimeError(f"jbatch serve exited with code {proc.wait()}")


def print_result(r: dict) -> None:
    print(f"\n== request rate {r['request_rate']} req/s: {r['completed']} ok, {r['failed']} failed "
          f"{r['errors'] or ''}, {r['duration_s']:.1f} s")  # fmt: skip
    good = f", goodput {r['goodput']:.2f} req/s" if r["goodput"] is not None else ""
    rate, out = r["request_throughput"], r["output_throughput"]
    print(f"request throughput {rate:.2f} req/s, output {out:.0f} tok/s{good}")
    print(f"{'ms':<6} {'mean':>9} {'median':>9} {'p99':>9}")
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[k]
        if s["mean"] is not None:
            print(f"{k[:-3]:<6} {s['mean']:>9.1f} {s['median']:>9.1f} {s['p99']:>9.1f}")


def plot_sweep(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in results if np.isfinite(r["request_rate"])]
    x = [r["request_rate"] for r in finite]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, [r["output_throughput"] for r in finite], "o-")
    a.set(xlabel="request rate (req/s, Poisson)", ylabel="output tok/s", title="Throughput")
    for key, label in (("ttft_ms", "TTFT"), ("e2e_ms", "e2e"), ("tpot_ms", "TPOT")):
        b.plot(x, [r[key]["p99"] for r in finite], "o-", label=f"p99 {label}")
    b.set(xlabel="request rate (req/s, Poisson)", ylabel="ms", title="p99 latency", yscale="log")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051", help="gRPC host:port of jbatch serve")
    ap.add_argument("--launch", metavar="MODEL", help="start `jbatch serve --model MODEL` first")
    ap.add_argument("--server-args", default="", help="extra flags for the launched server")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", default="inf", help="req/s; comma-separated for a sweep")
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--dataset", help="JSONL of {'prompt': str, 'max_tokens': int}")
    ap.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:500 tpot:50")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-file", help="write all results as JSON here")
    ap.add_argument("--plot", help="PNG of throughput and p99 latency vs request rate")
    args = ap.parse_args()
    slos = {}
    for item in args.goodput:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2e") or not value:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS, got {item!r}")
        slos[key] = float(value)
    rates = [float(r) for r in args.request_rate.split(",")]
    proc = None
    if args.launch:
        proc, args.target = launch_server(args.launch, args.server_args.split())
    try:
        info = asyncio.run(_model_info(args.target))
        if args.dataset:
            requests = jsonl_requests(args.dataset, args.num_prompts, args.output_len[1])
        else:
            requests = synthetic_requests(args, info.vocab_size)
        results = []
        for rate in rates:
            results.append(asyncio.run(run_benchmark(args.target, requests, rate, args.seed, slos)))
            print_result(results[-1])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    meta = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": info.model, "num_prompts": args.num_prompts, "slos_ms": slos}  # fmt: skip
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({**meta, "results": results}, indent=1))
    if args.plot:
        plot_sweep(results, args.plot)


async def _model_info(target: str):
    async with GenerationClient(target) as client:
        return await client.model_info()


if __name__ == "__main__":
    main()
