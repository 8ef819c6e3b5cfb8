"""Layer matmul efficiency on a real-size shape: the same dots, from one bare matmul up to the
whole decode step, timed interleaved in one process (medians), by wall clock and by the dots' own
time in a ``jax.profiler`` trace.

    python scripts/bench_matmul.py [--shape smollm2-135m | --model DIR] [--rows 32] [--reps 10]
                                   [--variants dot,layer,chain_hot,chain,step] [--no-trace]

Variants (T = ``--rows`` decode rows, the checkpoint's float32 weights; "dense layer" = both
norms, q/k/v/o, RoPE, gate/up/down, with attention replaced by a cheap stand-in):

* ``dot``: one ``[T, E] x [E, I]`` dot (gate_proj's shape), the same weight every call.
* ``layer``: one dense layer on layer 0's weights.
* ``chain_hot``: ``num_layers`` dense layers, all on layer 0's weights (cache-resident).
* ``chain``: the same program over every layer's own weights (streamed from DRAM each call).
* ``outin``: ``chain`` with the weights stored ``[out, in]`` (HF's layout).
* ``stacked``: ``chain`` on stacked ``[L, in, out]`` weights indexed inside the program.
* ``spin``: ``chain`` while a second Python thread spins (host work overlapping the device).
* ``step``: the real decode step: ``llama.forward`` over a paged KV pool, LM head, argmax.
* ``chain:OPTION=VALUE``: ``chain`` compiled with one XLA compiler option, e.g.
  ``chain:xla_cpu_experimental_ynn_fusion_type=`` (no YNNPACK: Eigen dots) or
  ``chain:xla_cpu_enable_fast_math=true``.

Per variant: wall ms, layer-matmul GFLOP/s (the dots' FLOPs / wall), CPU time / wall (how many
cores were busy) and, from the trace, the layer dots' own ms and GFLOP/s. XLA runs independent
ops (q/k/v, gate/up) concurrently on its two threads, so the traced dot times can add up to more
than the wall time: compare them between variants, not with the wall.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from bench_shapes import SHAPES, checkpoint_for

from jbatch.checkpoint import load_model
from jbatch.models import llama
from jbatch.models.config import ModelConfig
from jbatch.models.kv_cache import KVCache

ALL = ("dot", "layer", "chain_hot", "chain", "outin", "stacked", "spin", "step")
MATS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass
class Variant:
    call: Callable[[], jax.Array]  # one run, asynchronous
    hlo: str  # optimized HLO of the program (to find its dots)
    layer_flops: float  # FLOPs of the layer matmuls in one run


def dot_flops(hlo: str) -> dict[str, float]:
    """Op name -> FLOPs of its dot, for each fusion holding a dot and each unfused dot, from
    optimized HLO text (ops inside a fusion's own computation are not listed)."""
    comp_flops: dict[str, float] = {}  # computation -> FLOPs of the dots in it
    own: dict[str, float] = {}  # dot op -> its FLOPs
    shapes: dict[str, list[int]] = {}
    comp = None
    for line in hlo.splitlines():
        if m := re.match(r"^\s*(?:ENTRY\s+)?%(\S+)\s*\(.*->.*\{\s*$", line):
            comp, shapes = m.group(1), {}
            continue
        if not (m := re.match(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*f32\[([\d,]*)\]", line)):
            continue
        shapes[m.group(1)] = [int(s) for s in m.group(2).split(",") if s]
        if d := re.search(r" dot\(%([^,\s]+),\s*%[^)\s]+\).*lhs_contracting_dims=\{(\d+)\}", line):
            flops = 2.0 * np.prod(shapes[m.group(1)]) * shapes[d.group(1)][int(d.group(2))]
            own[m.group(1)] = flops
            comp_flops[comp] = comp_flops.get(comp, 0.0) + flops
    fusions = dict(re.findall(r"%(\S+)\s*=.*?\bfusion\(.*?calls=%([\w.\-]+)", hlo))
    fused = set(fusions.values())
    out = {op: comp_flops[c] for op, c in fusions.items() if c in comp_flops}
    inside = {op for c in fused for op in _ops_of(hlo, c)}
    out |= {op: f for op, f in own.items() if op not in inside}
    return out


def _ops_of(hlo: str, comp: str) -> list[str]:
    body = re.search(rf"^%{re.escape(comp)} .*?\{{\n(.*?)^\}}", hlo, re.M | re.S)
    return re.findall(r"^\s*(?:ROOT\s+)?%(\S+)\s*=", body.group(1), re.M) if body else []


def layer_dot_names(hlo: str, cfg: ModelConfig, rows: int) -> set[str]:
    """The dots whose FLOPs are those of a ``[rows, E] x [E, out]`` layer matmul."""
    e, kv, mlp = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    sizes = {2.0 * rows * e * o for o in (cfg.num_heads * cfg.head_dim, kv, mlp)}  # in/out alike
    return {n for n, f in dot_flops(hlo).items() if f in sizes}


def per_layer_flops(cfg: ModelConfig, rows: int) -> float:
    e, h, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return 2.0 * rows * (2 * e * h + 2 * e * kv + 3 * e * cfg.intermediate_size)


def dense_layer(cfg: ModelConfig, x, lp: dict, cos, sin, outin: bool = False):
    """One layer without attention (a cheap stand-in mixes q, k, v instead)."""

    def mm(a, w):
        return jax.lax.dot_general(a, w, (((1,), (1,)), ((), ()))) if outin else a @ w

    t, h, kvh, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    xn = llama.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = llama.apply_rope(mm(xn, lp["wq"]).reshape(t, h, d), cos, sin)
    k = llama.apply_rope(mm(xn, lp["wk"]).reshape(t, kvh, d), cos, sin)
    v = mm(xn, lp["wv"])
    attn = q.reshape(t, h * d) + jnp.tile(k.reshape(t, kvh * d) + v, (1, h // kvh))
    x = x + mm(attn, lp["wo"])
    xn = llama.rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    act = jax.nn.silu(mm(xn, lp["w_gate"])) * mm(xn, lp["w_up"])
    return x + mm(act, lp["w_down"])


def compiled(fn: Callable, *args, donate: tuple[int, ...] = (), options: dict | None = None):
    """``fn`` jitted and compiled for ``args``; ``options``: XLA compiler (debug) options."""
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile(compiler_options=options)


def parse_option(text: str) -> dict:
    """``"xla_cpu_enable_fast_math=true"`` -> ``{"xla_cpu_enable_fast_math": True}``."""
    key, _, value = text.partition("=")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return {key: lowered == "true"}
    return {key: int(value) if value.lstrip("-").isdigit() else value}


def chain_variant(
    cfg, layers, x, cos, sin, outin=False, stacked=False, n=None, options=None
) -> Variant:
    n = cfg.num_layers if n is None else n

    def chain(x, layers, cos, sin):
        for i in range(n):
            lp = {k: w[i] for k, w in layers.items()} if stacked else layers[i]
            x = dense_layer(cfg, x, lp, cos, sin, outin)
        return x

    c = compiled(chain, x, layers, cos, sin, options=options)
    return Variant(lambda: c(x, layers, cos, sin), c.as_text(), n * per_layer_flops(cfg, len(x)))


def step_variant(cfg: ModelConfig, params: dict, rows: int, ctx: int = 60) -> Variant:
    """``llama.forward`` decode of ``rows`` sequences of ``ctx`` tokens, LM head, argmax."""
    pages_per_seq, page_size = -(-(ctx + 1) // 16), 16
    tables = jnp.arange(rows * pages_per_seq, dtype=jnp.int32).reshape(rows, pages_per_seq)
    tokens, slots = jnp.arange(rows, dtype=jnp.int32) + 3, jnp.arange(rows, dtype=jnp.int32)
    pos = jnp.full((rows,), ctx, jnp.int32)

    def step(params, cache):
        h, cache = llama.forward(params, cfg, cache, tokens, pos, slots, tables, num_decode=rows)
        return cache, jnp.argmax(llama.compute_logits(params, h, cfg), axis=-1)

    def pool():
        return KVCache.zeros(cfg, rows * pages_per_seq + 1, page_size, jnp.float32)

    c = compiled(step, params, pool(), donate=(1,))
    state = {"cache": pool()}

    def call():
        state["cache"], tok = c(params, state["cache"])
        return tok

    return Variant(call, c.as_text(), cfg.num_layers * per_layer_flops(cfg, rows))


class Spinner:
    """A Python thread that spins while ``on`` (XLA's threads do not need the GIL)."""

    def __init__(self):
        self.on = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.on.wait()
            while self.on.is_set():
                pass


def build_variants(names, cfg, stacked, params, rows) -> dict[str, Variant]:
    layers = params["layers"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, cfg.hidden_size)), jnp.float32)
    cos, sin = llama.rope_tables(cfg.ropes[0], cfg.head_dim, jnp.arange(rows))
    hot = tuple(layers[0] for _ in layers)
    out: dict[str, Variant] = {}
    for name in names:
        if name == "dot":
            w = layers[0]["w_gate"]
            c = compiled(lambda x, w: x @ w, x, w)
            out[name] = Variant(lambda c=c, w=w: c(x, w), c.as_text(), 2.0 * x.size * w.shape[1])
        elif name == "layer":
            out[name] = chain_variant(cfg, layers, x, cos, sin, n=1)
        elif name == "chain_hot":
            out[name] = chain_variant(cfg, hot, x, cos, sin)
        elif name in ("chain", "spin"):
            out[name] = chain_variant(cfg, layers, x, cos, sin)
        elif name == "outin":
            t = tuple({k: (w.T.copy() if k in MATS else w) for k, w in lp.items()} for lp in layers)
            out[name] = chain_variant(cfg, jax.block_until_ready(t), x, cos, sin, outin=True)
        elif name == "stacked":
            out[name] = chain_variant(cfg, stacked, x, cos, sin, stacked=True)
        elif name == "step":
            out[name] = step_variant(cfg, params, rows)
        elif name.startswith("chain:"):
            out[name] = chain_variant(cfg, layers, x, cos, sin, options=parse_option(name[6:]))
        else:
            raise SystemExit(f"unknown variant {name!r}; choose from {ALL}")
    return out


def time_variants(variants: dict[str, Variant], reps: int, inner: int) -> dict[str, dict]:
    """Interleaved (A B C, A B C, ...): median wall seconds and CPU/wall per variant."""
    spinner = Spinner() if "spin" in variants else None
    walls = {k: [] for k in variants}
    busy = {k: [] for k in variants}
    for _ in range(reps):
        for name, v in variants.items():
            jax.block_until_ready(v.call())  # warm: caches hold what this program touches
            if name == "spin":
                spinner.on.set()
            t, cpu = time.perf_counter(), time.process_time()
            for _ in range(inner):
                r = v.call()
            jax.block_until_ready(r)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            if spinner:
                spinner.on.clear()
            walls[name].append(wall / inner)
            busy[name].append(cpu / wall)
    return {
        k: {"wall_s": float(np.median(walls[k])), "cpu_per_wall": float(np.median(busy[k]))}
        for k in variants
    }


def traced_dot_seconds(v: Variant, dots: set[str], runs: int) -> float:
    """Seconds per run spent in ``dots``, from a profiler trace of ``runs`` runs."""
    module = re.match(r"HloModule (\S+?),", v.hlo).group(1)
    trace_dir = tempfile.mkdtemp(prefix="jbatch-mm-trace-")
    jax.block_until_ready(v.call())
    jax.profiler.start_trace(trace_dir)
    for _ in range(runs):
        jax.block_until_ready(v.call())
    jax.profiler.stop_trace()
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    total = 0.0
    for e in events:
        a = e.get("args", {})
        if e.get("ph") == "X" and a.get("hlo_module") == module and a.get("hlo_op") in dots:
            total += e["dur"] / 1e6
    return total / runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint folder (default: the --shape checkpoint)")
    ap.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=32, help="decode rows (tokens) per call")
    ap.add_argument("--reps", type=int, default=10, help="interleaved rounds (medians)")
    ap.add_argument("--inner", type=int, default=3, help="calls per timed round")
    ap.add_argument("--variants", default="dot,layer,chain_hot,chain,outin,stacked,spin,step")
    ap.add_argument("--no-trace", action="store_true", help="skip the profiler pass")
    args = ap.parse_args()
    cfg, stacked = load_model(args.model or checkpoint_for(args.shape))
    params = llama.unstack_layers(stacked)
    names = args.variants.split(",")
    variants = build_variants(
        names, cfg, stacked["layers"] if "stacked" in names else None, params, args.rows
    )
    print(
        f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, rows {args.rows}; "
        f"{args.reps} interleaved rounds x {args.inner} calls, medians",
        flush=True,
    )
    load0 = os.getloadavg()[0]
    timed = time_variants(variants, args.reps, args.inner)
    print(f"load average (1 min) before / after: {load0:.1f} / {os.getloadavg()[0]:.1f}")
    print_table(variants, timed, cfg, args.rows, None if args.no_trace else args.inner * 2)


def print_table(variants, timed, cfg, rows: int, trace_runs: int | None) -> None:
    """One line per variant; GFLOP/s relative to the first variant; traced dot time if asked."""
    first = next(iter(variants))
    base = timed[first]["wall_s"] / variants[first].layer_flops
    width = max(10, *map(len, variants))
    head = f"{'variant':<{width}} {'wall ms':>8} {'GFLOP/s':>8} {'vs ' + first:>8} {'cpu/wall':>8}"
    print(head + ("" if trace_runs is None else "   dots ms  dots GFLOP/s  dots/wall"))
    for name, v in variants.items():
        w, fl = timed[name]["wall_s"], v.layer_flops
        line = f"{name:<{width}} {w * 1e3:8.2f} {fl / w / 1e9:8.1f} {base * fl / w:8.2f}"
        line += f" {timed[name]['cpu_per_wall']:8.2f}"
        if trace_runs is not None and name != "spin":
            dots = set(dot_flops(v.hlo)) if name == "dot" else layer_dot_names(v.hlo, cfg, rows)
            s = traced_dot_seconds(v, dots, trace_runs)
            line += f"   {s * 1e3:7.2f}  {fl / s / 1e9:12.1f}  {s / w:9.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
