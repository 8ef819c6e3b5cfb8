"""Speculative decoding vs plain decoding: output tok/s and tokens per target step, by batch size.

    PYTHONPATH=. python scripts/bench_speculative.py [--batches 1 4 32] [--reps 3]
        [--k 4] [--decode-steps 4] [--out docs/bench_speculative.json]

Workloads, greedy, on the built-in demo model (or ``--model``):

- ``edit``: n-gram's home ground — each prompt is 56 tokens of real Python source followed by
  its first 8 tokens again, so the continuation copies spans of the prompt (what an editing or
  refactoring agent's answer does); 48 output tokens.
- ``free``: free generation from 24 tokens of source; 64 output tokens (the draft model's
  case: ``--draft DIR``, default the demo model's 1-layer draft, ``jbatch/demo_model/draft``).
- ``reask``: an agent asking again with its earlier answer in the context — 24 tokens of
  source ``S``, the model's own 40-token greedy answer ``A`` to ``S``, then ``S`` again; 40
  output tokens. The demo model does not copy arbitrary text (``edit``'s continuation shares
  few spans with its prompt), but it does repeat its own answer here.

Each row reports ``copy_fraction``: the share of output tokens whose trigram (with the two
tokens before it) occurs in the prompt — how much of the output repeats prompt spans.

The demo model was trained on 128-token windows, so both stay within 128 positions (past
them its output degrades into noise no proposer predicts).

Three engines in one process — the same model and sizes, ``speculative=None``,
``speculative="ngram"`` and ``speculative_model=DRAFT`` — run each (workload, batch) in turn
(the order rotating; at batch 1 per request) for ``--reps`` repetitions; medians of the
ratios to plain are reported (the machine is shared: ratios, not absolute times). A batch of
B is B requests submitted together, ``--rounds`` times per repetition (batch 1: ``--solo``
requests one after another). Writes a JSON record and a PNG plot next to it.

``--decode-steps N`` (default: the engine's, 4): the speculative engines run up to N
speculative steps per dispatch (``jbatch/engine/spec_block.py``; 1: one per dispatch), and
for N > 1 a fourth engine, ``plain_blocks``, decodes without speculation in blocks of N steps
(``decode_block.py``): each row then also gives every speculative engine's ratio to it
(``*_vs_plain_blocks``), what speculation adds once both engines pay the launch and the
planning once per N steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

from jbatch import LLM, SamplingParams
from jbatch.demo import demo_draft_path, demo_model_path
from jbatch.engine.config import SPECULATIVE_DECODE_STEPS


def source_texts(n: int, chars: int) -> list[str]:
    """``n`` stretches of standard-library source (deterministic)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = []
    for f in files:
        text = f.read_text(errors="ignore")
        if len(text) > 4 * chars:
            mid = len(text) // 2
            start = text.index("\n", mid) + 1
            out.append(text[start : start + chars])
        if len(out) == n:
            break
    return out


WORKLOADS = {"edit": 48, "free": 64, "reask": 40}  # output tokens


def prompts_for(tokenizer, workload: str, n: int, answer=None) -> list[list[int]]:
    """``answer(prompts, max_tokens)``: greedy outputs of the plain engine (for ``reask``)."""
    ids = [tokenizer.encode(t) for t in source_texts(n, 1200)]
    if workload == "edit":  # the code, then its first tokens again: the rest is a copy
        return [t[:56] + t[:8] for t in ids]
    if workload == "reask":  # S, the model's answer to S, S again
        sources = [t[:24] for t in ids]
        return [s + a + s for s, a in zip(sources, answer(sources, WORKLOADS["reask"]))]
    return [t[:24] for t in ids]


def copy_fraction(prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Share of output tokens whose trigram ending at them occurs in the prompt."""
    hits = total = 0
    for prompt, out in zip(prompts, outputs):
        grams = {tuple(prompt[i : i + 3]) for i in range(len(prompt) - 2)}
        stream = prompt + out
        for i in range(len(prompt), len(stream)):
            hits += tuple(stream[i - 2 : i + 1]) in grams
        total += len(out)
    return hits / max(total, 1)


def run_all(engines: dict, batches: list[list[list[int]]], params: SamplingParams, rep: int):
    """One repetition on every engine: ``{name: result}``. Each batch of prompts runs on every
    engine in turn, the order rotating, so at batch 1 (one prompt per batch) a slow moment of
    the shared machine hits all engines alike."""
    names = list(engines)
    order = lambda i: names[i % len(names) :] + names[: i % len(names)]
    before = {name: llm.engine.stats() for name, llm in engines.items()}
    wall = dict.fromkeys(names, 0.0)
    outs = {name: [] for name in names}
    for i, batch in enumerate(batches):
        for name in order(rep + i):
            t0 = time.perf_counter()
            outs[name] += engines[name].generate(batch, params, use_tqdm=False)
            wall[name] += time.perf_counter() - t0
    return {name: _result(engines[name], before[name], outs[name], wall[name]) for name in names}


def _result(llm: LLM, before, outs, wall: float) -> dict:
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after.steps - before.steps
    proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 1),
        "steps": steps,
        "tokens_per_step": round(tokens / max(steps, 1), 3),
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "ids": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the built-in demo model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--solo", type=int, default=4, help="requests run one by one at batch 1")
    ap.add_argument("--workloads", nargs="+", default=["edit", "free", "reask"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--rounds", type=int, default=6, help="batch > 1: the batch runs this often per repetition"
    )
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft", help="draft checkpoint (default: the demo model's; 'none': skip)")
    ap.add_argument(
        "--methods", nargs="+", default=["ngram", "draft"], help="engines beside plain decoding"
    )
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=SPECULATIVE_DECODE_STEPS,
        help="speculative steps per dispatch (the engine's default); plain_blocks if > 1",
    )
    ap.add_argument("--out", default="docs/bench_speculative.json")
    args = ap.parse_args()
    model = args.model or str(demo_model_path())
    sizes = dict(max_slots=max(*args.batches, 4), num_pages=2048, max_seq_len=1024)
    spec = dict(num_speculative_tokens=args.k, decode_steps=args.decode_steps)
    engines = {"plain": LLM(model, **sizes)}
    if args.decode_steps > 1:
        engines["plain_blocks"] = LLM(model, **sizes, decode_steps=args.decode_steps)
    if "ngram" in args.methods:
        engines["ngram"] = LLM(model, **sizes, speculative="ngram", **spec)
    draft = args.draft or (None if args.model else str(demo_draft_path()))
    if draft and draft != "none" and "draft" in args.methods:
        engines["draft"] = LLM(model, **sizes, speculative_model=draft, **spec)
    tokenizer = engines["plain"].engine.tokenizer

    def answer(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = engines["plain"].generate(prompts, greedy, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    rows = []
    for workload in args.workloads:
        params = SamplingParams(temperature=0.0, max_tokens=WORKLOADS[workload], ignore_eos=True)
        for batch in args.batches:
            prompts = prompts_for(tokenizer, workload, args.solo if batch == 1 else batch, answer)
            reps = {name: [] for name in engines}
            names = list(engines)
            batches = [[p] for p in prompts] if batch == 1 else [prompts] * args.rounds
            # Untimed: each engine's first-run costs, and every prompt's prefill — every timed
            # repetition then finds its prompt in the prefix cache (both engines alike), so the
            # ratios compare decoding, where speculation acts.
            run_all(engines, batches, params, 0)
            for rep in range(args.reps):
                results = run_all(engines, batches, params, rep)
                for name in names:
                    reps[name].append(results[name])
            same = all(r["ids"] == reps["plain"][0]["ids"] for rs in reps.values() for r in rs)
            copied = round(copy_fraction(prompts, reps["plain"][0]["ids"]), 3)
            row = {"workload": workload, "batch": batch, "identical_outputs": same}
            row["copy_fraction"] = copied
            for name in names[1:]:
                ratios = [
                    s["output_tok_s"] / p["output_tok_s"] for s, p in zip(reps[name], reps["plain"])
                ]
                row[f"{name}_speedup_median"] = round(statistics.median(ratios), 3)
                row[f"{name}_speedups"] = [round(r, 3) for r in ratios]
                if "plain_blocks" in reps and name not in ("plain", "plain_blocks"):
                    pairs = zip(reps[name], reps["plain_blocks"])
                    vs = statistics.median(s["output_tok_s"] / p["output_tok_s"] for s, p in pairs)
                    row[f"{name}_vs_plain_blocks"] = round(vs, 3)
            for name, rs in reps.items():
                row[name] = {
                    key: statistics.median(r[key] for r in rs)
                    for key in ("output_tok_s", "tokens_per_step")
                }
                row[name]["acceptance_rate"] = rs[-1]["acceptance_rate"]
            rows.append(row)
            print(json.dumps(row))
    record = {
        "command": "PYTHONPATH=. python scripts/bench_speculative.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if v is not None and k != "out"
        ),
        "date": time.strftime("%Y-%m-%d"),
        "k": args.k,
        "rows": rows,
    }
    out = Path(args.out)
    out.write_text(json.dumps(record, indent=1))
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for workload in sorted({r["workload"] for r in rows}):
        for name in ("ngram", "draft", "plain_blocks"):
            key = f"{name}_speedup_median"
            pts = [(r["batch"], r[key]) for r in rows if r["workload"] == workload and key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{workload}, {name}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (concurrent requests)")
    ax.set_ylabel("tok/s, speculative / plain")
    ax.legend()
    ax.set_title("Speculative decoding, demo model, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
