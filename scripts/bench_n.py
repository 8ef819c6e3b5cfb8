"""n > 1 vs n separate requests: prompt tokens computed and throughput.

    PYTHONPATH=. python scripts/bench_n.py [--prompts 8] [--n 4] [--prompt-len 256] [--reps 2]

The same prompts run as ``SamplingParams(n=N, seed=s)`` (children share the prompt's full
pages) and as N separate requests with seeds ``s + i`` (each computes its prompt unless the
prefix cache finds it), with the prefix cache on and off, alternating over ``--reps``
repetitions on one warmed-up engine. Prints one JSON line per run (prompt tokens computed,
output tok/s, wall seconds) and how many completions differ between the two ways (float32
decode results depend on the batch's composition at the ~1e-6 level, so a near-tie can flip
a sampled token; 0 or a few, late in a completion).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jbatch import LLM, SamplingParams
from jbatch.demo import demo_model_path
from jbatch.engine.parent_request import child_seed


def run(llm: LLM, prompts, params: list[SamplingParams]) -> tuple[dict, list[list[int]]]:
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [c.token_ids for out in outs for c in out.outputs]
    after = llm.engine.stats()
    stats = {
        "prompt_tokens_computed": after.prompt_tokens - before.prompt_tokens,
        "steps": after.steps - before.steps,
        "output_tokens": sum(map(len, tokens)),
        "wall_s": round(wall, 3),
        "output_tok_s": round(sum(map(len, tokens)) / wall, 1),
    }
    return stats, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the built-in demo model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(
        args.model or str(demo_model_path()), max_slots=args.slots, max_num_batched_tokens=256,
        num_pages=1024, page_size=16, max_seq_len=args.prompt_len + args.max_tokens + 16,
    )  # fmt: skip
    vocab = llm.engine.model_cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    base = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True)
    parents = [base.replace(n=args.n, seed=100 * j) for j in range(args.prompts)]
    fanned = [base.replace(seed=child_seed(100 * j, i)) for j in range(args.prompts)
              for i in range(args.n)]  # fmt: skip
    separate = [p for p in prompts for _ in range(args.n)]
    for rep in range(args.reps):
        for caching in (False, True):
            results = {}
            for mode in ("n", "separate") if rep % 2 == 0 else ("separate", "n"):
                # A fresh scheduler (empty prefix cache) for every run; programs stay compiled.
                llm.engine.set_policies(enable_prefix_caching=caching)
                work = (prompts, parents) if mode == "n" else (separate, fanned)
                results[mode] = run(llm, *work)
            (one, want), (many, got) = results["n"], results["separate"]
            differ = sum(a != b for a, b in zip(want, got))
            for mode, stats in (("n", one), ("separate", many)):
                print(json.dumps({"rep": rep, "prefix_caching": caching, "mode": mode,
                                  "n": args.n, "prompts": args.prompts, **stats,
                                  "completions_differing": differ}))  # fmt: skip


if __name__ == "__main__":
    main()
