"""What top-k logprobs cost a batch that does not ask for them, and what asking costs.

    python scripts/bench_logprobs.py [--base-rev REV] [--reps 5] [--out docs/bench_logprobs.json]

Two warmed-up engines in their own processes, on the same random Llama (vocab 32 000, 4 layers,
hidden 256, float32) and the same seeded requests (greedy, ``ignore_eos``):

- **before**: the code at ``--base-rev`` (default: ``git merge-base HEAD main``, i.e. without
  logprobs), extracted with ``git archive``;
- **after**: this tree.

Workloads: ``plain`` (no request asks: the cheap path; run by both engines), ``top`` (every
request ``logprobs=5``) and ``prompt`` (every request ``logprobs=5, prompt_logprobs=5``: the LM
head on every prompt row). Repetitions are interleaved (before/plain, after/plain, after/top,
after/prompt, then again; one engine computes at a time); medians are reported.

Whole batches on a shared 2-core machine are noisy, so each repetition also times every step
program alone (an empty step input: the same compute, no request asks), ``STEP_CALLS`` calls per
bucket pair, before and after interleaved; per bucket the median over repetitions of each
repetition's median is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ENGINE = dict(
    max_slots=16, page_size=16, num_pages=512, max_seq_len=256, max_num_batched_tokens=256
)
REQUESTS, OUTPUT_TOKENS = 64, 32
STEP_CALLS = 20
RUNS = (("before", "plain"), ("after", "plain"), ("after", "top"), ("after", "prompt"))


def workload(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(16, 64))).tolist() for _ in range(REQUESTS)]


def worker(model: str) -> None:
    """Serve ``run WORKLOAD`` lines on stdin with one JSON line each (runs in either tree)."""
    from jbatch import LLM, SamplingParams

    llm = LLM(model, **ENGINE)
    prompts = workload(llm.engine.model_cfg.vocab_size)
    base = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    params = {
        "plain": base,
        "top": lambda: base.replace(logprobs=5),
        "prompt": lambda: base.replace(logprobs=5, prompt_logprobs=5),
    }
    llm.generate(prompts[:16], base, use_tqdm=False)  # warm the pool and host caches
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "quit":
            return
        if cmd[0] == "steps":
            print(json.dumps(time_steps(llm.engine)), flush=True)
            continue
        p = params[cmd[1]]
        p = p() if callable(p) else p
        llm.engine.set_policies(enable_prefix_caching=False)  # every run computes every prompt
        t0 = time.perf_counter()
        out = llm.generate(prompts, p, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        print(json.dumps({"wall_s": wall, "output_tokens": tokens}), flush=True)


def time_steps(engine) -> dict[str, float]:
    """Median seconds of one dispatch + fetch of each step program (empty input)."""
    core, out = engine.core, {}
    for rows, decode_rows in sorted(core.layouts):
        times = []
        for _ in range(STEP_CALLS):
            inp = core.new_input(rows, decode_rows)
            t0 = time.perf_counter()
            engine.state, pending = core.step(engine.params, engine.state, inp)
            core.fetch(pending)
            times.append(time.perf_counter() - t0)
        out[f"{rows}x{decode_rows}"] = float(np.median(times))
    return out


class Worker:
    def __init__(self, src: Path, model: str):
        env = {**os.environ, "PYTHONPATH": str(src), "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=src
        )
        self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited (code {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, name: str) -> dict:
        self.proc.stdin.write(f"run {name}\n")
        self.proc.stdin.flush()
        return self._read()

    def steps(self) -> dict[str, float]:
        self.proc.stdin.write("steps\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(120)


def extract(rev: str, into: Path) -> Path:
    """The tree at ``rev`` (``git archive``: no worktree, no change to the repository)."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--base-rev", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs/bench_logprobs.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from jbatch.tiny_model import write_random_llama

    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    rev = args.base_rev or git("merge-base", "HEAD", "main").strip()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_random_llama(Path(tmp) / "model", vocab_size=32000))
        (Path(tmp) / "base").mkdir()
        base = extract(rev, Path(tmp) / "base")
        workers = {"before": Worker(base, model), "after": Worker(ROOT, model)}
        runs: dict[str, list[float]] = {f"{e}/{w}": [] for e, w in RUNS}
        steps: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.reps):
            for engine, name in RUNS:
                runs[f"{engine}/{name}"].append(workers[engine].run(name)["wall_s"])
            for engine in steps:
                steps[engine].append(workers[engine].steps())
        for w in workers.values():
            w.close()
    median = {k: float(np.median(v)) for k, v in runs.items()}
    step_ms = {
        bucket: {e: 1e3 * float(np.median([r[bucket] for r in steps[e]])) for e in steps}
        for bucket in steps["after"][0]
    }
    tokens = REQUESTS * OUTPUT_TOKENS
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "base_rev": rev,
        "head_rev": git("rev-parse", "HEAD").strip(),
        "engine": ENGINE,
        "requests": REQUESTS,
        "output_tokens": tokens,
        "walls_s": runs,
        "median_wall_s": median,
        "output_tok_per_s": {k: tokens / v for k, v in median.items()},
        "plain_after_vs_before": median["after/plain"] / median["before/plain"] - 1,
        "top_vs_plain": median["after/top"] / median["after/plain"] - 1,
        "prompt_vs_plain": median["after/prompt"] / median["after/plain"] - 1,
        "step_ms_no_logprobs": step_ms,  # per bucket "prefill rows x decode rows"
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for k, v in median.items():
        print(f"{k:14s} median {v:7.3f} s  runs {' '.join(f'{x:.3f}' for x in runs[k])}")
    for k in ("plain_after_vs_before", "top_vs_plain", "prompt_vs_plain"):
        print(f"{k}: {100 * result[k]:+.1f}%")
    for bucket, ms in step_ms.items():
        b, a = ms["before"], ms["after"]
        print(f"step {bucket:8s} before {b:6.2f} ms  after {a:6.2f} ms  {100 * (a / b - 1):+.1f}%")


if __name__ == "__main__":
    main()
