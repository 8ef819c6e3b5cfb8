"""Quality, memory and speed of quantized settings against the unquantized model.

    PYTHONPATH=. python scripts/bench_quant.py [--models demo,random] [--windows 16]
                                               [--window 256] [--out docs/bench_quant.json]

Per model and setting (the rows of ``SETTINGS`` whose EngineConfig fields exist in this
checkout; the first row is the float32 reference):

* teacher-forced top-1 agreement with the reference: the fraction of held-out positions whose
  argmax next token is the reference's;
* perplexity on the held-out text (exp of the mean next-token NLL) and its change;
* params bytes, KV-pool bytes per token (every pool buffer, scales included);
* one layer-sized matmul, float vs int8 weights, float32 and bfloat16 activations;
* decode speed: output tokens/s of ``LLM.generate`` (greedy, 8 prompts x 64 tokens, 8 slots;
  the best of 3 runs after a warm-up run).

Teacher forcing runs each window of held-out tokens as one prompt chunk through ``forward`` over
the engine's own KV pool (``init_state(...).cache``: a quantized pool of the setting is written
and read back exactly as in serving). Models: ``demo`` (jbatch/demo_model, trained on the Python
standard library; held-out text: the validation files of its training split, reproduced with
``scripts/train_demo_model.py``'s own file list) and ``random`` (a random-weight 4-layer,
256-wide Llama with a 32 000 vocabulary, like ``bench_shapes``' toy, written to a temp folder;
the same held-out text through its tokenizer).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from train_demo_model import corpus_files

from jbatch import LLM, EngineConfig, SamplingParams
from jbatch.checkpoint import load_model
from jbatch.demo import demo_model_path
from jbatch.engine.state import init_state
from jbatch.models import llama
from jbatch.models.quant import ensure_quantized, matmul, quantize
from jbatch.parallel.loading import params_bytes
from jbatch.tiny_model import write_random_llama
from jbatch.tokenizer import Tokenizer

# name -> EngineConfig overrides; rows naming a field this checkout lacks are skipped.
SETTINGS = {
    "float32": {},
    "int8 weights": {"quantization": "int8"},
    "int8 weights + head": {"quantization": "int8", "quantize_lm_head": True},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "int8 weights + int8 KV": {"quantization": "int8", "kv_cache_dtype": "int8"},
}
PAGE_SIZE = 16


def held_out_text(max_chars: int) -> str:
    """The demo model's validation files (the first 2% of its seeded corpus order)."""
    files = corpus_files(30.0)
    n_val = max(1, len(files) // 50)
    text = "".join(f.read_text(errors="replace") for f in files[:n_val])
    return text[:max_chars]


def token_windows(tok: Tokenizer, text: str, windows: int, window: int) -> np.ndarray:
    ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
    need = windows * (window + 1)
    if len(ids) < need:
        raise SystemExit(f"held-out text has {len(ids)} tokens; need {need}")
    return ids[:need].reshape(windows, window + 1)


def engine_config(overrides: dict, window: int) -> EngineConfig:
    pages = window // PAGE_SIZE
    return EngineConfig(
        max_slots=1, page_size=PAGE_SIZE, num_pages=pages, max_seq_len=window, block_q=window,
        max_num_batched_tokens=window, **overrides,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0,))
def _window_logits(cfg, params, cache, tokens, tables):
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    slots = jnp.zeros_like(positions)
    h, _ = llama.forward(
        params, cfg, cache, tokens, positions, slots, tables,
        num_decode=0, block_q=tokens.shape[0], attn_impl="xla",
    )  # fmt: skip
    return jax.nn.log_softmax(llama.compute_logits(params, h, cfg), axis=-1)


def teacher_forced(cfg, params, ecfg: EngineConfig, windows: np.ndarray) -> np.ndarray:
    """Log-probs [windows, window, V] of every next token, each window from a fresh pool."""
    tables = jnp.arange(ecfg.num_pages, dtype=jnp.int32)[None]
    out = []
    for w in windows:
        cache = init_state(cfg, ecfg).cache
        out.append(np.asarray(_window_logits(cfg, params, cache, jnp.asarray(w[:-1]), tables)))
    return np.stack(out)


def kv_bytes_per_token(cfg, ecfg: EngineConfig) -> float:
    cache = jax.eval_shape(lambda: init_state(cfg, ecfg).cache)
    total = sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(cache))
    return total / (ecfg.num_pages * ecfg.page_size)


def decode_speed(model_dir: Path, overrides: dict, vocab: int, repeats: int = 3) -> float:
    llm = LLM(
        model_dir, max_slots=8, page_size=PAGE_SIZE, num_pages=128, max_seq_len=256,
        max_num_batched_tokens=128, **overrides,
    )  # fmt: skip
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, vocab, 16).tolist() for _ in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm caches
    best = 0.0
    for _ in range(repeats):  # the best of a few: the CPU is shared
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def bench_model(name: str, model_dir: Path, text: str, args) -> list[dict]:
    cfg, floats = load_model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    windows = token_windows(tok, text, args.windows, args.window)
    targets = windows[:, 1:]
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    rows, ref = [], None
    for setting, overrides in SETTINGS.items():
        missing = sorted(set(overrides) - fields)
        if missing:
            print(f"[{name}] {setting}: skipped (EngineConfig has no {missing})")
            continue
        ecfg = engine_config(overrides, args.window)
        params = ensure_quantized(floats, ecfg.weight_quant)
        logp = teacher_forced(cfg, params, ecfg, windows)
        nll = -np.take_along_axis(logp, targets[..., None], axis=-1).mean()
        top1 = logp.argmax(-1)
        ref = top1 if ref is None else ref
        row = dict(
            model=name, setting=setting, top1_agreement=float(np.mean(top1 == ref)),
            perplexity=float(np.exp(nll)), params_bytes=params_bytes(params),
            kv_bytes_per_token=kv_bytes_per_token(cfg, ecfg), tokens_per_s=None,
        )  # fmt: skip
        if not args.no_speed:
            row["tokens_per_s"] = decode_speed(model_dir, overrides, cfg.vocab_size)
        row["ppl_change"] = row["perplexity"] / rows[0]["perplexity"] - 1 if rows else 0.0
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def matmul_timings(shape=(8, 1024, 4096), calls: int = 50) -> list[dict]:
    """One ``[T, K] x [K, N]`` matmul, float weights vs ``quant.matmul`` on int8 ones, per
    activation dtype (interleaved, the median of 5 rounds of ``calls`` calls each)."""
    t, k, n = shape
    w = jax.random.normal(jax.random.key(0), (k, n))
    q, scale = quantize(w)
    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(jax.random.key(1), (t, k)).astype(dtype)
        fns = {
            "float": (jax.jit(lambda x, w: x @ w), (x, w.astype(dtype))),
            "int8": (jax.jit(matmul), (x, q, scale)),
        }
        times = {name: [] for name in fns}
        for _ in range(5):
            for name, (fn, fargs) in fns.items():
                fn(*fargs).block_until_ready()
                t0 = time.perf_counter()
                for _ in range(calls):
                    r = fn(*fargs)
                r.block_until_ready()
                times[name].append((time.perf_counter() - t0) / calls * 1e3)
        row = {"shape": list(shape), "dtype": jnp.dtype(dtype).name}
        row |= {f"{name}_ms": float(np.median(v)) for name, v in times.items()}
        print(f"matmul {shape} {row['dtype']}: float {row['float_ms']:.3f} ms, "
              f"int8 {row['int8_ms']:.3f} ms", flush=True)  # fmt: skip
        out.append(row)
    return out


def format_row(r: dict) -> str:
    speed = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
    return (
        f"| {r['model']} | {r['setting']} | {100 * r['top1_agreement']:.2f}% | "
        f"{r['perplexity']:.3f} | {100 * r['ppl_change']:+.2f}% | {r['params_bytes'] / 1e6:.2f} | "
        f"{r['kv_bytes_per_token']:.0f} | {speed} |"
    )


HEADER = (
    "| model | setting | top-1 agreement | perplexity | ppl change | params MB | KV bytes/token "
    "| decode tok/s |\n|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,random")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows per model")
    ap.add_argument("--window", type=int, default=256, help="tokens per window")
    ap.add_argument("--no-speed", action="store_true", help="skip the decode tok/s runs")
    ap.add_argument("--out", default="docs/bench_quant.json")
    args = ap.parse_args()
    text = held_out_text(2_000_000)
    matmuls = matmul_timings()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "demo":
                model_dir = demo_model_path()
            elif name == "random":
                model_dir = write_random_llama(Path(tmp) / "random", vocab_size=32000)
            else:
                raise SystemExit(f"unknown model {name!r} (demo, random)")
            rows += bench_model(name, model_dir, text, args)
    print("\n" + HEADER)
    for r in rows:
        print(format_row(r))
    meta = dict(
        date=datetime.date.today().isoformat(), machine=f"{platform.machine()} CPU",
        jax=jax.__version__, windows=args.windows, window=args.window,
    )  # fmt: skip
    result = {"meta": meta, "rows": rows, "matmul": matmuls}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
