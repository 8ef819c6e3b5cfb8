"""Soak test: a real ``jbatch serve`` process under a long mixed gRPC load.

``--streams`` streams arrive evenly over ``--duration`` seconds; ``--cancel`` of them cancel
after a few messages, ``--slow`` read with a pause between messages, the rest read normally.
Every stream draws its request from a pool whose solo outputs are taken first on the same
server, so each uncancelled stream must equal its reference exactly (a cancelled one: a
prefix). Every second the server's RSS (``/proc``), KV pages used, running slots and queue
depth (``/metrics``) and the open streams are sampled. Writes a JSON file and a plot.

    PYTHONPATH=. python scripts/soak.py --duration 600 --streams 2000   # the documented run
    PYTHONPATH=. python scripts/soak.py --duration 30 --streams 60      # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time

import httpx
import numpy as np

from jbatch import SamplingParams
from serving.client import GenerationClient, finish_reason_name

PROMPTS = [
    "def ", "import os\n", "class Parser:\n    def __init__(self", "for i in range(",
    "    return ", "# Copyright", "if __name__ == '__main__':\n", "with open(path) as f:\n",
    "try:\n    ", "def read_config(path):\n    \"\"\"", "x = [", "raise ValueError(",
]  # fmt: skip


def _start_server(args) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "jbatch.cli", "serve", "--grpc-port", "0", "--http-port", "0"]
    cmd += ["--max-slots", str(args.max_slots), "--stream-stall-timeout", "10"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for _ in range(200):
        line = proc.stderr.readline()
        if m := re.search(r"gRPC on [\d.]+:(\d+), HTTP on [\d.]+:(\d+)", line):
            http = f"http://127.0.0.1:{m.group(2)}"
            for _ in range(1200):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(http + "/health", timeout=2).status_code == 200:
                        return proc, f"127.0.0.1:{m.group(1)}", http
                time.sleep(0.1)
    proc.kill()
    raise RuntimeError("jbatch serve did not become ready")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _gauges(text: str) -> dict[str, float]:
    names = ("jbatch_kv_pages_used", "jbatch_running_slots", "jbatch_queue_depth")
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            out[parts[0][len("jbatch_") :]] = float(parts[1])
    return out


def _pool(n: int) -> list[tuple[str, SamplingParams]]:
    rng = np.random.RandomState(0)
    pool = []
    for i in range(n):
        max_tokens = int(rng.randint(16, 65))
        params = SamplingParams(
            temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, ignore_eos=True
        )
        pool.append((PROMPTS[i % len(PROMPTS)], params))
    return pool


async def _one(client, kind: str, prompt, params, rng_val: int, state: dict) -> tuple[str, list]:
    got: list[int] = []
    state["open"] += 1
    try:
        stream = client.generate(prompt, params, timeout=120)
        async with contextlib.aclosing(stream):
            n = 0
            async for resp in stream:
                got.extend(resp.token_ids)
                n += 1
                if kind == "cancel" and n >= 1 + rng_val % 5 and not resp.finish_reason:
                    return "cancelled", got
                if kind == "slow":
                    await asyncio.sleep(0.05)
                if resp.finish_reason:
                    assert finish_reason_name(resp) == "length"
        return "done", got
    except Exception as e:  # recorded, the soak goes on
        return f"error: {type(e).__name__}: {e}", got
    finally:
        state["open"] -= 1


async def _soak(args, target: str, http: str, pid: int) -> dict:
    pool = _pool(args.pool)
    async with GenerationClient(target) as client:
        refs = [(await client.complete(p, sp, timeout=120)).token_ids for p, sp in pool]
        rng = np.random.RandomState(1)
        kinds = rng.choice(
            ["cancel", "slow", "normal"], size=args.streams,
            p=[args.cancel, args.slow, 1 - args.cancel - args.slow],
        )  # fmt: skip
        picks = rng.randint(0, len(pool), size=args.streams)
        state, samples, results = {"open": 0}, [], [None] * args.streams
        t0 = time.monotonic()

        async def sampler():
            async with httpx.AsyncClient() as h:
                while True:
                    text = (await h.get(http + "/metrics")).text
                    samples.append(
                        {"t": time.monotonic() - t0, "rss_mib": _rss_mib(pid),
                         "open_streams": state["open"], **_gauges(text)}
                    )  # fmt: skip
                    await asyncio.sleep(1.0)

        async def launch(i: int):
            await asyncio.sleep(max(0.0, t0 + i * args.duration / args.streams - time.monotonic()))
            prompt, params = pool[picks[i]]
            results[i] = await _one(client, kinds[i], prompt, params, i, state)

        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(*(launch(i) for i in range(args.streams)))
        await asyncio.sleep(3.0)  # idle: every page must be back
        sampling.cancel()
        text = (await httpx.AsyncClient().get(http + "/metrics")).text
    idle = _gauges(text)
    mismatches = errors = 0
    for (outcome, got), i in zip(results, range(args.streams)):
        ref = refs[picks[i]]
        if outcome.startswith("error"):
            errors += 1
        elif (outcome == "done" and got != ref) or got != ref[: len(got)]:
            mismatches += 1
    warm = [s for s in samples if s["t"] >= args.warmup]
    rss0, rss1 = warm[0]["rss_mib"], warm[-1]["rss_mib"]
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "PYTHONPATH=. python scripts/soak.py " + " ".join(sys.argv[1:]),
        "streams": args.streams,
        "duration_s": args.duration,
        "wall_s": round(time.monotonic() - t0, 1),
        "kinds": {k: int((kinds == k).sum()) for k in ("normal", "slow", "cancel")},
        "done": sum(r[0] == "done" for r in results),
        "cancelled": sum(r[0] == "cancelled" for r in results),
        "errors": errors,
        "first_errors": [r[0] for r in results if r[0].startswith("error")][:5],
        "mismatches": mismatches,
        "rss_after_warmup_mib": round(rss0, 1),
        "rss_end_mib": round(rss1, 1),
        "rss_growth_pct": round(100 * (rss1 - rss0) / rss0, 2),
        "peak_open_streams": max(s["open_streams"] for s in samples),
        "peak_pages_used": max(s.get("kv_pages_used", 0) for s in samples),
        "idle_pages_used": idle.get("kv_pages_used"),
        "idle_running_slots": idle.get("running_slots"),
        "samples": samples,
    }


def _plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary["samples"]
    t = [x["t"] for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].plot(t, [x["rss_mib"] for x in s])
    axes[0].set_ylabel("server RSS (MiB)")
    axes[1].plot(t, [x.get("kv_pages_used", 0) for x in s])
    axes[1].set_ylabel("KV pages used")
    axes[2].plot(t, [x["open_streams"] for x in s])
    axes[2].set_ylabel("open streams")
    axes[2].set_xlabel("seconds")
    fig.suptitle(f"soak: {summary['streams']} streams over {summary['duration_s']} s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in demo model")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--cancel", type=float, default=0.20)
    parser.add_argument("--slow", type=float, default=0.05)
    parser.add_argument("--pool", type=int, default=48, help="distinct requests (references)")
    parser.add_argument("--max-slots", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=None, help="default: 10%% of --duration")
    parser.add_argument("--out", default="docs/bench_soak.json")
    parser.add_argument("--plot", default="docs/bench_soak.png")
    args = parser.parse_args()
    args.warmup = args.duration / 10 if args.warmup is None else args.warmup
    proc, target, http = _start_server(args)
    try:
        summary = asyncio.run(_soak(args, target, http, proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    _plot(summary, args.plot)
    brief = {k: v for k, v in summary.items() if k != "samples"}
    print(json.dumps(brief, indent=1))
    ok = summary["mismatches"] == 0 and summary["errors"] == 0 and not summary["idle_pages_used"]
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
