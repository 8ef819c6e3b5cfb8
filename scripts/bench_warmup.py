"""Engine-ready time: ``LLM(...)`` construction (load + warm-up of every program), cold vs warm
persistent compilation cache, for a random model of SmolLM2-135M's shape (30 layers).

Each measurement runs in a fresh process (nothing cached in memory): ``cold`` with the cache
disabled, then ``fill`` (first run into an empty cache directory) and ``warm`` (second run,
same directory). Results go to docs/bench_warmup.json.

    PYTHONPATH=. python scripts/bench_warmup.py              # 30 layers, default settings
    PYTHONPATH=. python scripts/bench_warmup.py --layers 4   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3)


def one_run(model: str, cache_dir: str) -> None:
    """Child process: time LLM(model) with default settings and print JSON."""
    os.environ["JBATCH_COMPILATION_CACHE"] = cache_dir
    t0 = time.perf_counter()
    from jbatch import LLM

    t_import = time.perf_counter() - t0
    llm = LLM(model)
    programs = len(llm.engine.core.layouts) if hasattr(llm.engine, "core") else None
    print(json.dumps(dict(seconds=time.perf_counter() - t0, import_s=t_import, programs=programs)))


def measure(model: str, cache_dir: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", model, "--cache", cache_dir],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--child", default=None)
    ap.add_argument("--cache", default="off")
    ap.add_argument("--out", default="docs/bench_warmup.json")
    args = ap.parse_args()
    if args.child:
        return one_run(args.child, args.cache)
    from jbatch.tiny_model import write_random_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / "model", num_layers=args.layers, **SMOL)
        cache = str(Path(tmp) / "xla_cache")
        rows = {"cold (cache off)": measure(str(model), "off")}
        rows["cold (empty cache, filling it)"] = measure(str(model), cache)
        rows["warm cache"] = measure(str(model), cache)
    result = dict(layers=args.layers, shape="SmolLM2-135M (576 wide, 9/3 heads, vocab 49152)",
                  settings="LLM(model) defaults, CPU", runs=rows)  # fmt: skip
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
