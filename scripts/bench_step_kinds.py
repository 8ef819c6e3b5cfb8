"""What one step of each kind costs, jbatch vs vLLM's CPU build: the parts a workload's time is
made of, so an end-to-end ratio (``bench_offline.py``) can be explained step kind by step kind.

    python scripts/bench_step_kinds.py [--shape smollm2-135m | --model DIR] [--reps 3]
                                       [--vllm-python VENV/bin/python] [--out OUT]

Every figure is a difference of two whole ``generate`` calls that differ in one thing, so the
warm-up, the first prefill and the engines' fixed costs cancel (token-id prompts, greedy,
``ignore_eos``):

* **decode step at n rows** (n = 1 ... 32): n prompts of 40 tokens generating 112 tokens minus
  the same generating 16, divided by the 96 extra steps;
* **prefill, per prompt token**: 32 prompts of 56 tokens minus 32 of 24 (one output token each),
  divided by the 1 024 extra prompt tokens;
* **a 40-token prompt beside 31 decodes**: 31 requests generating 200 tokens plus 128 one-token
  requests that take the 32nd slot one after another, minus the 31 alone, divided by 128 (the
  cost a long-tail workload pays each time a request ends and the next one is admitted).

Engines run in their own processes (``bench_offline.Worker``), interleaved, the order reversed
every other repetition; medians. Writes ``OUT.json`` and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from bench_offline import LABELS, rep_order, started_workers
from bench_shapes import SHAPES, checkpoint_for

DECODE_ROWS = (1, 2, 4, 8, 16, 32)
SHORT, LONG = 16, 112  # output tokens of the two decode runs
PREFILL = (24, 56)  # prompt lengths of the two prefill runs (32 prompts each)
MIXED_SLOTS, MIXED_PROMPTS, MIXED_OUT = 31, 128, 200


def make_workloads(vocab: int, seed: int) -> dict[str, dict]:
    rng = np.random.default_rng(seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [rng.integers(3, vocab, length).tolist() for _ in range(n)]

    work = {}
    for n in DECODE_ROWS:
        p = prompts(n, 40)
        work[f"decode{n}_short"] = {"prompts": p, "out_lens": [SHORT] * n}
        work[f"decode{n}_long"] = {"prompts": p, "out_lens": [LONG] * n}
    for length in PREFILL:
        work[f"prefill{length}"] = {"prompts": prompts(32, length), "out_lens": [1] * 32}
    running = prompts(MIXED_SLOTS, 40)
    work["mixed_alone"] = {"prompts": running, "out_lens": [MIXED_OUT] * MIXED_SLOTS}
    work["mixed_admitting"] = {
        "prompts": running + prompts(MIXED_PROMPTS, 40),
        "out_lens": [MIXED_OUT] * MIXED_SLOTS + [1] * MIXED_PROMPTS,
    }
    return work


def step_costs(wall: dict[str, float]) -> dict[str, float]:
    """Milliseconds per step kind from one repetition's walls (seconds per workload)."""
    costs = {
        f"decode step, {n} rows": (wall[f"decode{n}_long"] - wall[f"decode{n}_short"])
        / (LONG - SHORT)
        for n in DECODE_ROWS
    }
    extra_tokens = 32 * (PREFILL[1] - PREFILL[0])
    costs["prefill, per prompt token"] = (
        wall[f"prefill{PREFILL[1]}"] - wall[f"prefill{PREFILL[0]}"]
    ) / extra_tokens
    costs["40-token prompt beside 31 decodes"] = (
        wall["mixed_admitting"] - wall["mixed_alone"]
    ) / MIXED_PROMPTS
    return {k: 1e3 * v for k, v in costs.items()}


def plot(table: dict[str, dict[str, float]], engines: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(table)
    fig, ax = plt.subplots(figsize=(8, 4))
    ratios = [table[k][engines[1]] / table[k]["jbatch"] for k in kinds]
    bars = ax.barh(kinds, ratios, color="#4c72b0")
    ax.bar_label(bars, fmt="%.2fx", padding=3)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_title(f"{LABELS[engines[1]]} time / jbatch time, per step kind (median)")
    ax.invert_yaxis()
    ax.set_xlim(0, max(ratios) * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the --shape checkpoint)")
    ap.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", default="jbatch,vllm", help="jbatch first, then one peer")
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench_step_kinds")
    args = ap.parse_args()
    if args.model is None:
        args.model = str(checkpoint_for(args.shape))
    engines = args.engines.split(",")
    if len(engines) != 2 or engines[0] != "jbatch":
        raise SystemExit(f"--engines takes 'jbatch,PEER', got {args.engines!r}")
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    work = make_workloads(vocab, args.seed)
    work_file = Path(args.out).with_suffix(".workload.json")
    per_rep: dict[str, list[dict[str, float]]] = {e: [] for e in engines}
    with started_workers(engines, args.model, work, work_file, 32, args.vllm_python) as workers:
        for rep in range(args.reps):
            for w in rep_order(workers, rep):
                time.sleep(1.0)
                wall = {name: w.run(name)["wall_s"] for name in work}
                per_rep[w.engine].append(step_costs(wall))
                print(f"rep {rep} {w.engine}: {json.dumps(per_rep[w.engine][-1])}", flush=True)
    kinds = list(per_rep["jbatch"][0])
    table = {k: {e: float(np.median([r[k] for r in per_rep[e]])) for e in engines} for k in kinds}
    peer = engines[1]
    print(f"\n{'step kind':<36} {'jbatch ms':>10} {peer + ' ms':>10} {peer + '/jbatch':>12}")
    for k, row in table.items():
        ratio = row[peer] / row["jbatch"]
        print(f"{k:<36} {row['jbatch']:>10.2f} {row[peer]:>10.2f} {ratio:>11.2f}x")
    meta = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": args.model, "reps": args.reps}  # fmt: skip
    out = {**meta, "median_ms": table, "per_repetition_ms": per_rep}
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1))
    plot(table, engines, Path(args.out).with_suffix(".png"))
    print(f"\nwrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
