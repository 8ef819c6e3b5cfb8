"""Scale run: 10 000 synthetic prompts through one ``LLM.generate`` call.

    python scripts/bench_scale.py [--requests 10000] [--model DIR] [--slots 64]

Shows that a large offline batch completes with a progress bar, that host memory stays bounded
(resident set size sampled every 0.25 s while it runs), and what slot utilization the engine
reaches while requests are still queued. Writes ``OUT.json`` and ``OUT.png`` (RSS over time).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

from jbatch import LLM, SamplingParams
from jbatch.demo import demo_model_path


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RssSampler(threading.Thread):
    def __init__(self, period: float = 0.25):
        super().__init__(daemon=True)
        self.period, self.samples, self.stop = period, [], threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.samples.append((time.perf_counter() - self.t0, rss_mb()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the built-in demo model)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(4, 24), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench_scale")
    args = ap.parse_args()
    model = args.model or str(demo_model_path())
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(
            3, vocab, int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
        ).tolist()
        for _ in range(args.requests)
    ]
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, ignore_eos=True, max_tokens=int(n))
        for i, n in enumerate(
            rng.integers(args.output_len[0], args.output_len[1] + 1, args.requests)
        )
    ]
    llm = LLM(
        model,
        max_slots=args.slots,
        page_size=16,
        num_pages=args.slots * 8,
        max_num_batched_tokens=512,
        max_seq_len=128,
    )
    rss_before = rss_mb()
    sampler = RssSampler()
    sampler.start()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)  # the progress bar is LLM.generate's own
    wall = time.perf_counter() - t
    sampler.stop.set()
    sampler.join()
    stats = llm.engine.stats()
    assert len(outs) == args.requests
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, params))
    out_tokens = sum(p.max_tokens for p in params)
    rss = [r for _, r in sampler.samples] or [rss_mb()]
    result = {
        "command": "python scripts/bench_scale.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "requests": args.requests,
        "slots": args.slots,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall,
        "prompt_tokens": sum(map(len, prompts)),
        "steps": int(stats.steps),
        "utilization_while_queued": stats.busy_slots_while_queued
        / max(1, stats.steps_while_queued * args.slots),
        "rss_mb_before": rss_before,
        "rss_mb_max_during": max(rss),
        "rss_mb_last_quarter_max": max(rss[len(rss) * 3 // 4 :]),
        "peak_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps(result, indent=1))
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([s for s, _ in sampler.samples], [r for _, r in sampler.samples])
    ax.set(xlabel="seconds", ylabel="RSS (MiB)", ylim=(0, max(rss) * 1.2))
    ax.set_title(f"{args.requests} requests through LLM.generate: host memory")
    fig.tight_layout()
    fig.savefig(Path(args.out).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
