"""Scheduler policies measured on one warmed-up engine (random 4-layer Llama, CPU):

(a) shared system prompt: prefix cache on vs off — prompt tokens computed, tok/s, hit rate;
(b) memory pressure: recompute vs swap preemption — tok/s, p99 end-to-end latency;
(c) long low-priority prompts behind a flood of short requests: p99 wait with and without aging.

    python scripts/bench_scheduler.py

Prints tables, writes docs/bench_scheduler.json and docs/bench_scheduler.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from jbatch import LLM, SamplingParams
from jbatch.tiny_model import write_random_llama


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, arrivals: list[list[tuple[list[int], int, int]]]) -> dict:
    """``arrivals[k]``: (prompt, max_tokens, priority) arriving before step k; steps until done."""
    eng = llm.engine
    eng.counters.clear()
    sched = eng.scheduler
    seqs, done_at, t0 = [], {}, time.monotonic()
    step = 0
    while step < len(arrivals) or eng.has_unfinished_requests():
        for prompt, max_tokens, prio in arrivals[step] if step < len(arrivals) else []:
            rid = eng.add_request(prompt, greedy(max_tokens), priority=prio)
            seqs.append((eng.requests[rid], sched.num_steps))
        for out in eng.step():
            if out.finished:
                done_at[out.request_id] = time.monotonic()
        step += 1
    wall = time.monotonic() - t0
    tokens = sum(len(s.output_ids) for s, _ in seqs)
    e2e = [done_at[s.request_id] - s.arrival_time for s, _ in seqs]
    waits = {
        p: [s.first_scheduled_step - a for s, a in seqs if s.priority == p]
        for p in {s.priority for s, _ in seqs}
    }
    result = {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall,
        "prompt_tokens_computed": int(eng.stats().prompt_tokens),
        "prefix_hit_rate": sched.allocator.hit_rate,
        "preemptions": sched.num_preemptions,
        "swap_outs": int(eng.stats().swap_outs),
        "p50_e2e_s": float(np.percentile(e2e, 50)),
        "p99_e2e_s": float(np.percentile(e2e, 99)),
        "p99_wait_steps": {str(p): float(np.percentile(w, 99)) for p, w in waits.items()},
        "max_wait_steps": {str(p): int(max(w)) for p, w in waits.items()},
    }
    eng.forget_finished()
    return result


def shared_prefix(rng, vocab, n=48, system=384, suffix=16, out=16):
    sys_prompt = rng.integers(3, vocab, system).tolist()
    return [[(sys_prompt + rng.integers(3, vocab, suffix).tolist(), out, 0) for _ in range(n)]]


def pressure(rng, vocab, n=24, prompt=64, out=160):
    return [[(rng.integers(3, vocab, prompt).tolist(), out, 0) for _ in range(n)]]


def flood(rng, vocab, steps=200, per_step=3, long_every=50, long_len=400):
    arrivals = []
    for k in range(steps):
        now = [(rng.integers(3, vocab, 8).tolist(), 4, 0) for _ in range(per_step)]
        if k % long_every == 5:
            now.append((rng.integers(3, vocab, long_len).tolist(), 8, 1))
        arrivals.append(now)
    return arrivals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: a random 4-layer Llama)")
    ap.add_argument("--out", default="docs/bench_scheduler")
    args = ap.parse_args()
    model = args.model or write_random_llama(
        "/tmp/jbatch-bench-llama", vocab_size=32000, tokenizer=False
    )
    llm = LLM(
        model,
        max_slots=8,
        page_size=16,
        num_pages=96,
        max_num_batched_tokens=256,
        max_seq_len=1024,
        preemption_mode="auto",
    )
    eng, vocab = llm.engine, llm.engine.model_cfg.vocab_size
    results = {}
    for name, policies, make in [
        ("a_prefix_off", dict(enable_prefix_caching=False), shared_prefix),
        ("a_prefix_on", dict(enable_prefix_caching=True), shared_prefix),
        ("b_recompute", dict(preemption_mode="recompute", enable_prefix_caching=False), pressure),
        ("b_swap", dict(preemption_mode="swap", enable_prefix_caching=False), pressure),
        ("c_no_aging", dict(aging_steps=0), flood),
        ("c_aging_16", dict(aging_steps=16), flood),
    ]:
        eng.set_policies(
            **{
                "enable_prefix_caching": True,
                "aging_steps": 64,
                "preemption_mode": "auto",
                **policies,
            }
        )
        results[name] = run(llm, make(np.random.default_rng(0), vocab))
        r = results[name]
        print(
            f"{name:<13} {r['output_tok_per_s']:7.0f} tok/s  prompt tokens computed "
            f"{r['prompt_tokens_computed']:6d}  hit rate {r['prefix_hit_rate']:5.1%}  "
            f"preemptions {r['preemptions']:3d} (swaps {r['swap_outs']:3d})  p99 e2e "
            f"{r['p99_e2e_s']:6.2f}s  p99 wait {r['p99_wait_steps']}  max wait "
            f"{r['max_wait_steps']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {"machine": platform.platform(), "date": time.strftime("%Y-%m-%d"), "results": results},
            indent=1,
        )
    )
    plot(results, out.with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    pairs = [
        ("a_prefix_off", "a_prefix_on", "prompt_tokens_computed", "(a) prompt tokens computed"),
        ("b_recompute", "b_swap", "p99_e2e_s", "(b) p99 end-to-end latency (s)"),
        ("c_no_aging", "c_aging_16", None, "(c) max wait of long prompts (steps)"),
    ]
    for ax, (x, y, key, title) in zip(axes, pairs):
        vals = [
            results[k]["max_wait_steps"].get("1", 0) if key is None else results[k][key]
            for k in (x, y)
        ]
        ax.bar([x[2:], y[2:]], vals, color=["#999", "#2a7"])
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path} and {path.with_suffix('.json')}")


if __name__ == "__main__":
    main()
