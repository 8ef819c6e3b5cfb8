"""Engine-ready time: ``LLM(...)`` construction (load + warm-up of every program), cold vs warm
persistent compilation cache, for a random model of SmolLM2-135M's shape (30 layers).

Each measurement runs in a fresh process (nothing cached in memory): ``cold`` with the cache
disabled, then ``fill`` (first run into an empty cache directory, which also fills the
executable store, ``jbatch/engine/executable_store.py``) and ``warm`` runs in the same
directory: once with the store off (JAX's persistent cache alone: tracing and lowering every
program again), twice with it. Results go to docs/bench_warmup.json.

    PYTHONPATH=. python scripts/bench_warmup.py              # 30 layers, default settings
    PYTHONPATH=. python scripts/bench_warmup.py --layers 4   # quicker
    PYTHONPATH=. python scripts/bench_warmup.py --shapes-only   # 32 x 4096 (Llama-3-8B shape)

``--shapes-only`` compiles (no weights, no run) every step program of a 32-layer 4096-wide
model on abstract params: lowering serially, then ``precompile.compile_all``.
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


def one_run(model: str, cache_dir: str, store: bool) -> None:
    """Child process: time LLM(model) with default settings and print JSON. ``store=False``
    keeps the executable store off (the persistent compilation cache alone)."""
    os.environ["JBATCH_COMPILATION_CACHE"] = cache_dir
    t0 = time.perf_counter()
    from jbatch import LLM
    from jbatch.engine.executable_store import ExecutableStore

    t_import = time.perf_counter() - t0
    if not store:
        ExecutableStore.from_compilation_cache = classmethod(lambda cls: None)
    llm = LLM(model)
    core = llm.engine.core
    print(json.dumps(dict(seconds=round(time.perf_counter() - t0, 2), import_s=round(t_import, 2),
                          programs=len(core.layouts), **core.warmup_programs)))  # fmt: skip


LLAMA3_8B = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
)  # fmt: skip


def shapes_only(dtype: str = "bfloat16") -> dict:
    """Compile time of every default step program of a Llama-3-8B-shaped model, abstractly."""
    import jax
    import jax.numpy as jnp

    from jbatch.engine.config import EngineConfig
    from jbatch.engine.engine_core import EngineCore
    from jbatch.engine.precompile import compile_all
    from jbatch.engine.sizing import resolve
    from jbatch.engine.state import init_state
    from jbatch.models.config import ModelConfig
    from jbatch.param_layout import expected_param_shapes

    model_cfg = ModelConfig.from_hf_dict(LLAMA3_8B)
    cfg = resolve(EngineConfig(dtype=dtype, max_seq_len=2048), model_cfg)
    shapes = expected_param_shapes(model_cfg)
    sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    params = {k: sds(v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = tuple(
        {k: sds(v[1:]) for k, v in shapes["layers"].items()} for _ in range(model_cfg.num_layers)
    )
    core = EngineCore(model_cfg, cfg)
    state = jax.eval_shape(lambda: init_state(model_cfg, cfg))
    t0 = time.perf_counter()
    lowered = [core.lower_step(params, state, *key) for key in core.layouts]
    t1 = time.perf_counter()
    compile_all(lowered)
    t2 = time.perf_counter()
    return dict(model="Llama-3-8B shape (32 x 4096, 32/8 heads, vocab 128256)", dtype=dtype,
                programs=len(lowered), trace_lower_s=round(t1 - t0, 1),
                compile_s=round(t2 - t1, 1))  # fmt: skip


def measure(model: str, cache_dir: str, store: bool = True) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", model, "--cache", cache_dir]
        + ([] if store else ["--no-store"]),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--child", default=None)
    ap.add_argument("--cache", default="off")
    ap.add_argument("--out", default="docs/bench_warmup.json")
    ap.add_argument("--shapes-only", action="store_true")
    ap.add_argument("--no-store", action="store_true", help="child: executable store off")
    args = ap.parse_args()
    if args.child:
        return one_run(args.child, args.cache, store=not args.no_store)
    if args.shapes_only:
        result = shapes_only()
        print(json.dumps(result))
        Path("docs/bench_warmup_8b_shapes.json").write_text(json.dumps(result, indent=2) + "\n")
        return None
    from jbatch.tiny_model import write_random_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / "model", num_layers=args.layers, **SMOL)
        cache = str(Path(tmp) / "xla_cache")
        rows = {"cold (cache off)": measure(str(model), "off")}
        rows["cold (empty cache, filling it)"] = measure(str(model), cache)
        rows["warm cache, executable store off"] = measure(str(model), cache, store=False)
        rows["warm cache + executable store"] = measure(str(model), cache)
        rows["warm cache + executable store (again)"] = measure(str(model), cache)
    result = dict(layers=args.layers, shape="SmolLM2-135M (576 wide, 9/3 heads, vocab 49152)",
                  settings="LLM(model) defaults, CPU", runs=rows)  # fmt: skip
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
