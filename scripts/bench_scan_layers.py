"""Compile time and per-step time of the model pass: today's unrolled per-layer params vs a
``lax.scan`` over stacked layers, for a random model of SmolLM2-135M's shape (30 layers).

The scan variant (written here, not used by the engine) runs one layer body over stacked
``[L, ...]`` weights and a stacked ``[L, P, S, KVH, D]`` pool (scanned as xs, the updated pool
returned as ys). It compiles one layer instead of 30 but slices each layer's pool in and out
every step. Both jit with the pool donated; step = a decode bucket of 8 rows, and a mixed
bucket (8 decode rows + 16 prompt rows), 512 pages of 16 (the engine's default pool).

    PYTHONPATH=. python scripts/bench_scan_layers.py [--layers 30] [--out docs/bench_scan.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jbatch.models import llama
from jbatch.models.config import ModelConfig
from jbatch.models.kv_cache import KVCache, write_locations
from jbatch.models.rope import apply_rope, rope_tables

SMOL = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=True,
)  # fmt: skip


def forward_scan(params, cfg, k_pool, v_pool, tokens, positions, slots, page_tables, num_decode):
    """llama.forward for a homogeneous dense model, as a scan over layers (block_q = 16)."""
    t, d = tokens.shape[0], cfg.head_dim
    x = params["embed"][jnp.clip(tokens, 0, cfg.vocab_size - 1)]
    cos, sin = rope_tables(cfg.ropes[0], d, positions)
    pages, offsets = write_locations(
        page_tables, slots, positions, k_pool.shape[2], k_pool.shape[1]
    )

    def body(x, layer):
        lp, kp, vp = layer
        xn = llama.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q = (xn @ lp["wq"]).reshape(t, cfg.num_heads, d)
        k = (xn @ lp["wk"]).reshape(t, cfg.num_kv_heads, d)
        v = (xn @ lp["wv"]).reshape(t, cfg.num_kv_heads, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kp = kp.at[pages, offsets].set(k, mode="drop")
        vp = vp.at[pages, offsets].set(v, mode="drop")
        cache = KVCache(k=(kp,), v=(vp,))
        attn = llama._attention(
            q, cache, 0, slots, positions, page_tables, num_decode, 16, None, "xla"
        )
        x = x + attn.reshape(t, -1) @ lp["wo"]
        xn = llama.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        x = x + (jax.nn.silu(xn @ lp["w_gate"]) * (xn @ lp["w_up"])) @ lp["w_down"]
        return x, (kp, vp)

    x, (k_pool, v_pool) = jax.lax.scan(body, x, (params["layers"], k_pool, v_pool))
    return llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps), k_pool, v_pool


def batch(cfg, num_decode, prompt_rows, pages_per_seq, rng):
    t = num_decode + prompt_rows
    positions = np.concatenate([rng.randint(100, 400, num_decode), np.arange(prompt_rows)])
    slots = np.concatenate([np.arange(num_decode), np.full(prompt_rows, num_decode - 1)])
    tables = np.arange(8 * pages_per_seq, dtype=np.int32).reshape(8, pages_per_seq)
    tokens = rng.randint(0, cfg.vocab_size, t)
    return [jnp.asarray(a, jnp.int32) for a in (tokens, positions, slots, tables)]


def measure(cfg, params_stacked, num_decode, prompt_rows, reps=5):
    rng = np.random.RandomState(0)
    num_pages, page_size = 512, 16
    tokens, positions, slots, tables = batch(cfg, num_decode, prompt_rows, 64, rng)
    per_layer = llama.unstack_layers(params_stacked)
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    res = {}

    def unrolled(params, cache, *a):
        h, cache = llama.forward(params, cfg, cache, *a, num_decode=num_decode, block_q=16,
                                 attn_impl="xla")  # fmt: skip
        return h, cache

    def scanned(params, k, v, *a):
        return forward_scan(params, cfg, k, v, *a, num_decode)

    variants = {
        "unrolled (per-layer params, today)": (
            unrolled, lambda: (per_layer, KVCache.zeros(cfg, num_pages, page_size, jnp.float32)),
            (1,),
        ),
        "lax.scan (stacked layers)": (
            scanned, lambda: (params_stacked, jnp.zeros(shape), jnp.zeros(shape)), (1, 2),
        ),
    }  # fmt: skip
    for name, (fn, state, donate) in variants.items():
        st = state()
        args = (*st, tokens, positions, slots, tables)
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        compile_s = time.perf_counter() - t0
        out = compiled(*args)
        jax.block_until_ready(out)
        steps = []
        for _ in range(reps):
            st = (st[0], *out[1:]) if len(out) == 3 else (st[0], out[1])
            args = (*st, tokens, positions, slots, tables)
            t0 = time.perf_counter()
            out = compiled(*args)
            jax.block_until_ready(out)
            steps.append(time.perf_counter() - t0)
        res[name] = dict(compile_s=round(compile_s, 1), step_ms=round(1e3 * np.median(steps), 1))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", default="docs/bench_scan.json")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf_dict(SMOL | dict(num_hidden_layers=args.layers))
    from jbatch.param_layout import expected_param_shapes

    rng = np.random.RandomState(1)
    make = lambda s: jnp.asarray(rng.randn(*s).astype(np.float32) * 0.02)
    shapes = expected_param_shapes(cfg)
    params = {k: make(s) for k, s in shapes.items() if k != "layers"}
    params["layers"] = {k: make(s) for k, s in shapes["layers"].items()}
    out = {}
    for label, (nd, pr) in {"decode 8 rows": (8, 0), "mixed 8 + 16 rows": (8, 16)}.items():
        out[label] = measure(cfg, params, nd, pr)
        print(label, json.dumps(out[label]))
    result = dict(layers=args.layers, backend=jax.default_backend(), pool="512 pages x 16",
                  results=out)  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
