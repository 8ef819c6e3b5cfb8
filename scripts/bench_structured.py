"""Structured output: JSON-schema-constrained requests beside free ones on one engine.

    PYTHONPATH=. python scripts/bench_structured.py [--requests 200] [--reps 5] [--slots 32]
                                                    [--out docs/bench_structured.json]

Workloads, on the demo model (one engine, compiled once; every workload runs once per
repetition, in turn, so the machine's noise falls on all of them alike):

* ``constrained``: ``--requests`` requests over four JSON Schemas (nested objects, enums,
  arrays, numbers with bounds), sampled and seeded;
* ``free``: as many unconstrained requests (sampled, seeded, ``ignore_eos``) whose lengths are
  those of the constrained outputs (from a calibration run), so both workloads make the same
  tokens in the same shape of long tail and differ only by the constraint;
* ``mixed``: both sets together, shuffled.

Reported: output tokens/s per workload (median over repetitions), the constrained / free
ratio, whether every constrained output parses and validates (``jsonschema``), compilations
after warm-up (must be 0), host time filling bitmasks, and steps that waited for the previous
step's tokens (the lockstep the grammar needs). Writes a JSON file and a PNG bar chart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import random
import statistics
import time
from pathlib import Path

import jax
import jsonschema

from jbatch import LLM, SamplingParams
from jbatch.demo import demo_model_path
from jbatch.structured_output import StructuredOutput

_STR = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": _STR,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": _STR,
            "address": {
                "type": "object",
                "properties": {"street": _STR, "city": _STR, "zip": {"type": "integer",
                               "minimum": 10000, "maximum": 99999}},
                "required": ["street", "city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"enum": ["A-1", "B-2", "C-3", "D-4"]},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 20}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 4,
            },
            "express": {"type": "boolean"},
        },
        "required": ["id", "items", "express"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 5},
            "tags": {"type": "array", "items": {"enum": ["fast", "slow", "buggy", "clean"]},
                     "maxItems": 3},
        },
        "required": ["sentiment", "score", "tags"],
        "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["search", "open_file", "run_tests"]},
            "arguments": {
                "type": "object",
                "properties": {"query": _STR, "limit": {"type": "integer", "minimum": 1,
                               "maximum": 50}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}  # fmt: skip
PROMPTS = [
    "def parse_config(path):\n    ",
    "import json\n\ndata = ",
    "class Order:\n    def __init__(self",
    "# Return the user record as JSON\n",
    "The result of the query is ",
    "config = {\n    ",
]


def constrained_requests(n: int) -> list[tuple[str, SamplingParams]]:
    names = list(SCHEMAS)
    constrained = [
        (PROMPTS[(i + 1) % len(PROMPTS)],
         SamplingParams(temperature=0.8, seed=10_000 + i, max_tokens=320,
                        structured=StructuredOutput(json=SCHEMAS[names[i % len(names)]])))
        for i in range(n)
    ]  # fmt: skip
    return constrained


def workloads(constrained, lengths: list[int]) -> dict[str, list[tuple[str, SamplingParams]]]:
    free = [
        (PROMPTS[i % len(PROMPTS)],
         SamplingParams(temperature=0.8, seed=i, max_tokens=max(n, 1), ignore_eos=True))
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    mixed = free + constrained
    random.Random(0).shuffle(mixed)
    return {"free": free, "constrained": constrained, "mixed": mixed}


def run(llm: LLM, requests) -> dict:
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    invalid = 0
    for (_, sp), out in zip(requests, outs):
        if sp.structured is None:
            continue
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), sp.structured.schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            invalid += 1
    return dict(
        seconds=seconds,
        tokens=tokens,
        tok_s=tokens / seconds,
        constrained_requests=sum(sp.structured is not None for _, sp in requests),
        invalid=invalid,
        steps=after.steps - before.steps,
        lockstep_steps=after.constrained_steps - before.constrained_steps,
        bitmask_seconds=after.bitmask_seconds - before.bitmask_seconds,
    )


class _CompileCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("Compiling ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument(
        "--overlap", action="store_true", help="EngineConfig.structured_overlap: a constrained "
        "step's forward runs while its bitmask is filled"
    )  # fmt: skip
    ap.add_argument("--out", default="docs/bench_structured.json")
    args = ap.parse_args()

    llm = LLM(demo_model_path(), max_slots=args.slots, num_pages=1024, max_seq_len=512,
              max_num_batched_tokens=256, structured_overlap=args.overlap)  # fmt: skip
    constrained = constrained_requests(args.requests)
    calibration = llm.generate(  # also warms the host paths (grammar cache, tokenizer)
        [p for p, _ in constrained], [sp for _, sp in constrained], use_tqdm=False
    )
    loads = workloads(constrained, [len(o.outputs[0].token_ids) for o in calibration])
    counter = _CompileCounter()
    logging.getLogger("jax").addHandler(counter)
    logging.getLogger("jax").setLevel(logging.DEBUG)
    results: dict[str, list[dict]] = {name: [] for name in loads}
    with jax.log_compiles(True):
        for rep in range(args.reps):
            for name, reqs in loads.items():
                r = run(llm, reqs)
                results[name].append(r)
                print(f"rep {rep} {name:12s} {r['tok_s']:8.1f} tok/s  {r['tokens']:6d} tokens  "
                      f"invalid {r['invalid']}  lockstep {r['lockstep_steps']}/{r['steps']} steps "
                      f"bitmask {1e3 * r['bitmask_seconds']:.0f} ms", flush=True)  # fmt: skip
    median = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in results.items()}
    ratios = [c["tok_s"] / f["tok_s"] for c, f in zip(results["constrained"], results["free"])]
    summary = dict(
        tok_s_median=median,
        constrained_over_free=statistics.median(ratios),
        constrained_over_free_per_rep=ratios,
        invalid=sum(r["invalid"] for rs in results.values() for r in rs),
        constrained_outputs=sum(r["constrained_requests"] for rs in results.values() for r in rs),
        compiles_after_warmup=counter.count,
        bitmask_share=statistics.median(
            r["bitmask_seconds"] / r["seconds"] for r in results["constrained"]
        ),
    )
    print("\nworkload      tok/s (median of", args.reps, "reps)")
    for name, v in median.items():
        print(f"{name:12s} {v:8.1f}")
    print(f"constrained / free = {summary['constrained_over_free']:.2f} "
          f"(per rep: {', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    print(f"invalid constrained outputs: {summary['invalid']} of {summary['constrained_outputs']}"
          f"; compiles after warm-up: {counter.count}; bitmask share of constrained time: "
          f"{100 * summary['bitmask_share']:.1f}%")  # fmt: skip
    record = dict(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()} {platform.processor()} jax {jax.__version__}",
        args=vars(args),
        summary=summary,
        runs=results,
    )
    out = Path(args.out)
    out.write_text(json.dumps(record, indent=1))
    _plot(median, out.with_suffix(".png"))
    print(f"wrote {out}")


def _plot(median: dict[str, float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(list(median), list(median.values()), color=["#888", "#3a7", "#37a"])
    ax.set_ylabel("output tokens / s (median)")
    ax.set_title("JSON-schema constrained vs free, demo model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
