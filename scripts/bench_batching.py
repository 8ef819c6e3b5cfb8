"""Continuous vs static batching on one engine, on a long-tail output-length workload.

    python scripts/bench_batching.py --requests 256 --slots 8

Static batching fills every slot, then waits for the whole batch to finish before admitting the
next; continuous batching refills a slot the step after it frees. Both use the same warmed-up
engine and the same requests (``ignore_eos``, so output lengths are fixed). Prints a table, writes
JSON and a PNG of slot utilization over time.
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


def make_workload(args) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed)
    n_long = round(args.requests * args.long_frac)
    lens = np.concatenate(
        [
            rng.integers(args.long_min, args.long_max + 1, n_long),
            rng.integers(args.short_min, args.short_max + 1, args.requests - n_long),
        ]
    )
    rng.shuffle(lens)
    prompts = [
        rng.integers(3, args.vocab, rng.integers(args.prompt_min, args.prompt_max + 1)).tolist()
        for _ in range(args.requests)
    ]
    return prompts, [int(x) for x in lens]


def ideal_steps(out_lens: list[int], slots: int) -> tuple[int, int]:
    """Decode steps with perfect slot reuse: static = sum of per-batch maxima; continuous =
    the work spread evenly over the slots (a lower bound: no request splits across slots)."""
    static = sum(max(out_lens[i : i + slots]) for i in range(0, len(out_lens), slots))
    continuous = max(-(-sum(out_lens) // slots), max(out_lens))
    return static, continuous


def run(llm: LLM, prompts, out_lens, static: bool) -> dict:
    eng = llm.engine
    eng.counters.clear()
    slots = llm.config.max_slots
    timeline, busy_while_waiting = [], []
    groups = (
        [list(range(i, min(i + slots, len(prompts)))) for i in range(0, len(prompts), slots)]
        if static
        else [list(range(len(prompts)))]
    )
    t0 = time.perf_counter()
    for group in groups:
        for i in group:
            eng.add_request(
                prompts[i], SamplingParams(temperature=0.0, max_tokens=out_lens[i], ignore_eos=True)
            )
        while eng.has_unfinished_requests():
            eng.step()
            snapshot = eng.stats()
            running = snapshot.running
            timeline.append(running)
            if (static and group is not groups[-1]) or snapshot.waiting:
                busy_while_waiting.append(running / slots)
    wall = time.perf_counter() - t0
    eng.forget_finished()
    tokens = sum(out_lens)
    stats = eng.stats()
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall,
        "steps": stats.steps,
        "decode_rows": stats.decode_rows,
        "slot_utilization": stats.decode_rows / (stats.steps * slots),
        "utilization_while_waiting": float(np.mean(busy_while_waiting or [0.0])),
        "host_overhead_pct": 100 * stats.host_only_seconds / wall,
        "timeline": timeline,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: a random 4-layer Llama)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--long-frac", type=float, default=0.1)
    ap.add_argument("--long-min", type=int, default=256)
    ap.add_argument("--long-max", type=int, default=512)
    ap.add_argument("--short-min", type=int, default=4)
    ap.add_argument("--short-max", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=8)
    ap.add_argument("--prompt-max", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench_batching")
    args = ap.parse_args()
    model = args.model or write_random_llama(
        "/tmp/jbatch-bench-llama", vocab_size=32000, tokenizer=False
    )
    llm = LLM(
        model,
        max_slots=args.slots,
        page_size=16,
        num_pages=1024,
        max_num_batched_tokens=256,
        max_seq_len=1024,
    )
    args.vocab = llm.engine.model_cfg.vocab_size
    prompts, out_lens = make_workload(args)
    results = {
        mode: run(llm, prompts, out_lens, static=(mode == "static"))
        for mode in ("static", "continuous")
    }
    ideal_static, ideal_cont = ideal_steps(out_lens, args.slots)
    ideal = ideal_static / ideal_cont
    speedup = results["continuous"]["output_tok_per_s"] / results["static"]["output_tok_per_s"]
    print(
        f"\n{args.requests} requests, {args.slots} slots, outputs {sum(out_lens)} tokens "
        f"({args.long_frac:.0%} of {args.long_min}-{args.long_max}, rest "
        f"{args.short_min}-{args.short_max})"
    )
    print(
        f"{'mode':<11} {'tok/s':>8} {'wall s':>8} {'steps':>6} {'util':>6} "
        f"{'util|wait':>9} {'host %':>7}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<11} {r['output_tok_per_s']:8.0f} {r['wall_s']:8.2f} {r['steps']:6d} "
            f"{r['slot_utilization']:6.1%} {r['utilization_while_waiting']:9.1%} "
            f"{r['host_overhead_pct']:7.1f}"
        )
    print(
        f"continuous / static: {speedup:.2f}x; ideal ceiling {ideal:.2f}x "
        f"({ideal_static} vs {ideal_cont} decode steps); reached {speedup / ideal:.0%}"
    )
    summary = {
        "args": vars(args),
        "machine": platform.platform(),
        "processor": platform.processor(),
        "date": time.strftime("%Y-%m-%d"),
        "speedup": speedup,
        "ideal_ceiling": ideal,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(results, out.with_suffix(".png"), args.slots)


def plot(results: dict, path: Path, slots: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for mode, r in results.items():
        ax.plot(r["timeline"], label=f"{mode} ({r['output_tok_per_s']:.0f} tok/s)", lw=0.8)
    ax.set(
        xlabel="engine step",
        ylabel="running slots",
        ylim=(0, slots + 0.5),
        title="Slot utilization: static vs continuous batching",
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path} and {path.with_suffix('.json')}")


if __name__ == "__main__":
    main()
