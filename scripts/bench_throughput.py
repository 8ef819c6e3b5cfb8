"""Offline throughput sanity check: jbatch vs HF transformers ``generate`` (one padded batch).

    python scripts/bench_throughput.py [--prompts 32 --prompt-len 32 --max-tokens 64 --reps 3]

Each engine runs in its own process (XLA's and torch's thread pools fight when they share one);
repetitions alternate A B A B and the median is reported. Not the full peer benchmark (vLLM,
HF continuous batching): that is ``scripts/bench_offline.py``'s job once it exists.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def workload(args) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(3, args.vocab, (args.prompts, args.prompt_len)).tolist()


def run_jbatch(args) -> list[float]:
    from jbatch import LLM, SamplingParams

    llm = LLM(
        args.model,
        max_slots=args.prompts,
        page_size=16,
        num_pages=1024,
        max_num_batched_tokens=512,
        max_seq_len=512,
    )
    p = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rates = []
    for _ in range(args.reps):
        t = time.perf_counter()
        outs = llm.generate(workload(args), p, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    return rates


def run_hf(args) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = torch.tensor(workload(args))
    rates = []
    for _ in range(args.reps):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                pad_token_id=0,
            )
        rates.append(args.prompts * args.max_tokens / (time.perf_counter() - t))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine", choices=["jbatch", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from jbatch.tiny_model import write_random_llama

        args.model = str(
            write_random_llama("/tmp/jbatch-bench-llama", vocab_size=32000, tokenizer=False)
        )
    args.vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    if args.engine:  # child process: print the rates as JSON
        print(json.dumps((run_jbatch if args.engine == "jbatch" else run_hf)(args)))
        return
    base = [
        sys.executable,
        __file__,
        "--model",
        args.model,
        "--prompts",
        str(args.prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--max-tokens",
        str(args.max_tokens),
        "--reps",
        "1",
    ]
    rates: dict[str, list[float]] = {"jbatch": [], "hf": []}
    for _ in range(args.reps):  # A B A B: each engine in a fresh process
        for name in rates:
            out = subprocess.run(
                [*base, "--engine", name], capture_output=True, text=True, check=True
            )
            rates[name] += json.loads(out.stdout.strip().splitlines()[-1])
    med = {k: float(np.median(v)) for k, v in rates.items()}
    print(f"{args.prompts} prompts x {args.prompt_len} tokens -> {args.max_tokens} tokens")
    for k, v in rates.items():
        print(f"{k:<7} median {med[k]:7.0f} output tok/s  runs {[round(x) for x in v]}")
    print(f"jbatch / HF generate: {med['jbatch'] / med['hf']:.2f}x")


if __name__ == "__main__":
    main()
