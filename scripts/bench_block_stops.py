"""Blocks of decode steps on requests that end by a stop token, with and without the device's
early end (``decode_block.py``).

    python scripts/bench_block_stops.py [--model DIR] [--slots 32] [--requests 256]
                                        [--decode-steps 8 16] [--no-ablation] [--median 48]
                                        [--stop-kind token|string] [--reps 3]
                                        [--out docs/bench_block_stops]

Workload (the demo model, or ``--model``; greedy): each request stops at a token of its own
greedy output — the first token, at or after a log-normal position (median ``--median``, 48
by default; 1-399), that has not appeared earlier in it (none: it runs to 400 tokens) — so
output lengths are a long tail ending by a stop token, as EOS ends them, while the host cannot
know them when it plans a block. ``--stop-kind string``: the stop is that token's text as a stop
string instead (``SamplingParams.stop``; it may match earlier, inside other tokens' text). The
host finds a stop string in the detokenized text after a block lands; the device never sees it,
so a block runs to its planned end past one (a stop string is the one end a block can neither
plan for nor end early at). The step-by-step engine computes the outputs first; every run must
reproduce their lengths.

Engines, one process, runs interleaved ``--reps`` times: step by step (``decode_steps=1``),
and per ``--decode-steps`` value blocks with the device's early end, and (unless
``--no-ablation``) blocks without it (its core's step clears the stop ids the host sends, so
the device runs each block to its planned count: the engine before the early end). Prints
wall-time medians, the ratio to step by step, host share, dispatches per step, steps and
blocks ended early; writes OUT.json, OUT.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from bench_report import write_summary

from jbatch import LLM, SamplingParams
from jbatch.demo import demo_model_path


def engine(model: str, slots: int, decode_steps: int, early_end: bool = True) -> LLM:
    llm = LLM(
        model, max_slots=slots, num_pages=2048, max_seq_len=512,
        max_num_batched_tokens=256, decode_steps=decode_steps,
    )  # fmt: skip
    if not early_end:
        core, step = llm.engine.core, llm.engine.core.step

        def step_without_stop_ids(params, state, inp, bitmask=None):
            inp.batch.block_stop_tokens.fill(-1)
            return step(params, state, inp, bitmask)

        core.step = step_without_stop_ids
    return llm


def workload(
    llm: LLM, requests: int, seed: int, median: int, stop_kind: str = "token"
) -> tuple[list, list, list[int]]:
    """Prompts, per-request params (one stop token id or stop string each), and the output
    lengths."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 500, rng.integers(16, 64)).tolist() for _ in range(requests)]
    full_params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, full_params, use_tqdm=False)
    at = np.clip(rng.lognormal(np.log(median), 0.8, requests), 1, 399).astype(int)
    params, lens = [], []
    for out, p in zip(outs, at):
        ids = out.outputs[0].token_ids
        q = next((q for q in range(p, len(ids)) if ids[q] not in ids[:q]), None)
        params.append(full_params.replace(stop_token_ids=[ids[q]] if q is not None else []))
        lens.append(len(ids) if q is None else q + 1)
    if stop_kind == "string":  # the same tokens' text; lengths as the step-by-step engine ends
        decode = llm.tokenizer.decode
        texts = [decode([p.stop_token_ids[0]]) if p.stop_token_ids else "" for p in params]
        # (a token that is part of a UTF-8 character decodes to U+FFFD alone: no stop string)
        params = [full_params.replace(stop=[t] if t and "\ufffd" not in t else None) for t in texts]
        lens = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        # A tokenizer smaller than the model's vocabulary (bench_shapes.py's random checkpoints)
        # decodes most ids to "": those requests get no stop string and run to 400 tokens.
        print(f"{sum(bool(p.stop) for p in params)} of {requests} requests have a stop string")
    return prompts, params, lens


def timed_run(llm: LLM, prompts, params, lens: list[int]) -> dict:
    eng = llm.engine
    before, t0 = eng.stats(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, after = time.perf_counter() - t0, eng.stats()
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != lens:
        raise AssertionError("output lengths differ from step by step")
    steps = after.steps - before.steps
    return {
        "wall_s": wall,
        "tok_per_s": sum(lens) / wall,
        "steps": steps,
        "dispatches_per_step": (after.dispatches - before.dispatches) / steps,
        "host_share": (after.host_only_seconds - before.host_only_seconds) / wall,
        "blocks_ended_early": after.blocks_ended_early - before.blocks_ended_early,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the demo model)")
    ap.add_argument("--no-ablation", action="store_true", help="skip the no-early-end engines")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--median", type=int, default=48, help="median stop position (tokens)")
    ap.add_argument("--stop-kind", choices=("token", "string"), default="token",
                    help="end each request by a stop token id or by that token's text")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench_block_stops")
    args = ap.parse_args()
    model = args.model or str(demo_model_path())
    engines = {"step by step": engine(model, args.slots, 1)}
    prompts, params, lens = workload(
        engines["step by step"], args.requests, args.seed, args.median, args.stop_kind
    )
    for n in args.decode_steps:
        engines[f"blocks of {n}"] = engine(model, args.slots, n)
        if not args.no_ablation:
            engines[f"blocks of {n}, no early end"] = engine(model, args.slots, n, False)
    for llm in engines.values():  # warm caches and the pool
        llm.generate(prompts[: args.slots], params[: args.slots], use_tqdm=False)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.reps):
        for name, llm in engines.items():
            runs[name].append(timed_run(llm, prompts, params, lens))
    base = float(np.median([r["wall_s"] for r in runs["step by step"]]))
    rows = []
    for name, rs in runs.items():
        wall = float(np.median([r["wall_s"] for r in rs]))
        med = lambda key: float(np.median([r[key] for r in rs]))  # noqa: B023
        rows.append({
            "engine": name, "median_wall_s": wall, "tok_per_s": sum(lens) / wall,
            "vs_step_by_step": base / wall, "host_share": med("host_share"),
            "dispatches_per_step": med("dispatches_per_step"), "steps": med("steps"),
            "blocks_ended_early": med("blocks_ended_early"), "runs": rs,
        })  # fmt: skip
    print(f"\n{Path(model).name}, {args.slots} slots, {args.requests} requests ending by a stop "
          f"{args.stop_kind} ({sum(lens)} output tokens, median {np.median(lens):.0f}), "
          f"median of {args.reps} interleaved runs")  # fmt: skip
    print(f"{'engine':<28} {'tok/s':>7} {'vs steps':>9} {'host':>6} {'disp/step':>10} "
          f"{'steps':>6} {'ended early':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['engine']:<28} {r['tok_per_s']:7.0f} {r['vs_step_by_step']:8.2f}x "
              f"{r['host_share']:6.1%} {r['dispatches_per_step']:10.2f} {r['steps']:6.0f} "
              f"{r['blocks_ended_early']:12.0f}")  # fmt: skip
    out = write_summary(args.out, output_tokens=sum(lens), rows=rows)
    plot(rows, args, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, share) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r["engine"] for r in rows]
    tput.barh(names, [r["tok_per_s"] for r in rows], color="tab:blue")
    tput.set(xlabel="output tokens/s", title="throughput")
    tput.invert_yaxis()
    share.barh(names, [100 * r["host_share"] for r in rows], color="tab:orange")
    share.set(xlabel="host share of the wall time (%)", title="host time")
    share.invert_yaxis()
    share.set_yticklabels([])
    name = Path(args.model).name if args.model else "demo model"
    ended = f"stop-{args.stop_kind}-ended"
    fig.suptitle(f"{name}, {args.slots} slots, {args.requests} {ended} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
