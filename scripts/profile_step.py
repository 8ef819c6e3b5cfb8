"""Where a decode step's time goes: a ``jax.profiler`` trace of one ``LLM.generate`` run, with the
XLA ops of the jitted step summed per step and grouped by kind.

    python scripts/profile_step.py [--shape toy|smollm2-135m | --model DIR] [--slots 32]
                                   [--prompt-len 40] [--max-tokens 64]

Prints the top ops (ms per step) and a grouping: the LM head (the dot whose output is
``[slots, vocab]``), other matmuls, paged attention (the chunk loop and what runs inside it),
and the rest (sampling, scatter, norms). Reads the perfetto trace JAX writes, so it needs no
TensorBoard.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import numpy as np
from bench_shapes import SHAPES, checkpoint_for

from jbatch import LLM, SamplingParams


def op_times(trace_dir: str) -> collections.Counter:
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    total: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith("$") or "::" in name or "Pjit" in name:
            continue  # Python frames and runtime bookkeeping: keep XLA ops only
        total[name] += e.get("dur", 0) / 1e3
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the --shape checkpoint)")
    ap.add_argument("--shape", choices=SHAPES, default="toy", help="see bench_shapes.py")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.model is None:
        args.model = str(checkpoint_for(args.shape))
    llm = LLM(args.model, max_slots=args.slots, num_pages=args.slots * 32, max_seq_len=512)
    vocab = llm.engine.model_cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.slots)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm caches
    steps0 = llm.engine.stats().steps
    trace_dir = tempfile.mkdtemp(prefix="jbatch-trace-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    llm.generate(prompts, params, use_tqdm=False)
    jax.profiler.stop_trace()
    steps = llm.engine.stats().steps - steps0
    ops = op_times(trace_dir)
    print(f"{steps} steps traced; top XLA ops, ms per step:")
    for name, ms in ops.most_common(15):
        print(f"{ms / steps:8.2f}  {name}")
    groups: collections.Counter = collections.Counter()
    other: collections.Counter = collections.Counter()
    for name, ms in ops.items():
        kind = re.sub(r"\.\d+$", "", name)
        if kind in ("while", "transpose_copy_fusion", "dot"):
            groups["paged attention (XLA chunk loop)"] += ms
        elif kind == "ffi_call":  # the native CPU kernel (pallas_kernels/cpu_attention.py)
            groups["paged attention (native CPU kernel)"] += ms
        elif kind == "ynn_fusion":
            groups["matmuls (YNNPACK)"] += ms
        else:
            groups["everything else (sampling, scatter, norms, ...)"] += ms
            other[kind] += ms
    head = max((ms for n, ms in ops.items() if n.startswith("ynn_fusion")), default=0.0)
    groups["matmuls (YNNPACK)"] -= head
    groups["LM head (largest dot)"] = head
    total = sum(groups.values())
    print("\ngrouped (ms per step, share):")
    for name, ms in groups.most_common():
        print(f"{ms / steps:8.2f}  {100 * ms / total:5.1f}%  {name}")
    print("\neverything else, by op kind (ms per step):")
    for kind, ms in other.most_common(10):
        print(f"{ms / steps:8.2f}  {kind}")


if __name__ == "__main__":
    main()
