"""Multi-device checks, run in a subprocess that sees several (simulated) devices.

``tests/test_parallel.py`` starts ``python -m tests.parallel_worker MODE ...`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (which must be set before JAX starts,
while the main pytest process has one device) and asserts on the JSON this prints last.

Modes:
* ``matrix CKPT CONFIGS``: the continuous-batching workload on each ``TPxDP`` of CONFIGS
  (e.g. ``1x1,2x1,4x1,8x1,4x2``; ``2x1:pallas_interpret`` picks the attention, ``2x1::int8``
  the KV cache dtype); per config:
  each request's tokens, compilations after warm-up, and every param's and KV buffer's
  sharding (spec, global shape, per-device shard shapes, devices).
* ``load_rss CKPT TP [naive]``: peak host RSS while loading CKPT sharded over TP devices
  (``naive``: load whole params on the host, then ``shard_params``, for comparison).
* ``stored CKPT DIR``: a tp=2 engine and a dp=2 pair, each built twice over the executable
  store in DIR (the second build loads every step program).
* ``multihost CKPT PORT PROC_ID NPROC``: one process of a multi-process run (tp over all
  processes' devices) of the same workload.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def engine_config(**kw):
    from jbatch.engine.config import EngineConfig

    # Tiny pool (12 pages of 4 tokens for 4 slots): sequences get preempted and swapped to host.
    base = dict(
        max_slots=4, page_size=4, num_pages=12, max_num_batched_tokens=8, block_q=8,
        max_seq_len=48, preemption_mode="swap",
    )  # fmt: skip
    return EngineConfig(**{**base, **kw})


# (prompt tokens, max_tokens, step at which the request arrives)
WORKLOAD = [
    (list(range(3, 6)), 10, 0),
    (list(range(10, 27)), 8, 0),
    (list(range(40, 49)), 12, 2),
    (list(range(60, 65)), 6, 4),
    (list(range(70, 82)), 9, 4),
    (list(range(90, 97)), 7, 7),
]


def run_workload(engine) -> dict[str, list[int]]:
    """Requests arrive while others run; every request's greedy tokens, by request id."""
    from jbatch.outputs import OutputKind
    from jbatch.sampling_params import SamplingParams

    outs: dict[str, list[int]] = {}
    pending = sorted(enumerate(WORKLOAD), key=lambda x: x[1][2])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _) = pending.pop(0)
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(prompt, sp, request_id=f"q{i}", output_kind=OutputKind.FINAL)
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        if step > 500:
            raise RuntimeError("workload did not finish")
    return outs


def describe(arr) -> dict:
    spec = arr.sharding.spec
    return {
        "spec": [None if s is None else str(s) for s in spec],
        "shape": list(arr.shape),
        "shard_shapes": sorted({tuple(s.data.shape) for s in arr.addressable_shards}),
        "devices": sorted(d.id for d in arr.sharding.device_set),
    }


def describe_engine(engine) -> dict:
    import jax

    params = {
        "/".join(str(getattr(k, "key", k)) for k in path): describe(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(engine.params)[0]
    }
    cache = engine.state.cache
    return {
        "params": params,
        "kv": [describe(a) for a in (*cache.k, *cache.v)],
        "kv_scales": [describe(a) for a in (*(cache.k_scale or ()), *(cache.v_scale or ()))],
        "slot_arrays": describe(engine.state.page_tables),
        "num_kv_heads": engine.model_cfg.num_kv_heads,
    }


def step_collectives(engine) -> dict[str, int]:
    """Collectives in the compiled decode step, as ``"op <- jax op"``: count."""
    import collections
    import re

    core = engine.core
    decode_rows = core.cfg.max_slots  # the decode-only program of the largest decode bucket
    lowered = core.lower_step(engine.params, engine.state, 0, decode_rows)
    found: collections.Counter = collections.Counter()
    for line in lowered.compile().as_text().splitlines():
        m = re.search(r" (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                      r"(?:-start)?\(", line)  # fmt: skip
        if m:
            src = re.search(r'op_name="[^"]*?/([^"/]+)"', line)
            found[f"{m.group(1)} <- {src.group(1) if src else '?'}"] += 1
    return dict(found)


def matrix(ckpt: str, configs: str) -> dict:
    import jax

    from jbatch.models.config import ModelConfig
    from jbatch.parallel import build_engines
    from jbatch.parallel.router import ReplicaRouter
    from tests.compile_counter import count_compiles

    model_cfg = ModelConfig.from_file(os.path.join(ckpt, "config.json"))
    results = {}
    for config in configs.split(","):
        # e.g. "2x1:pallas_interpret"; a fourth field: decode_steps (blocks of decode steps)
        mesh, impl, kv, steps = (config.split(":") + ["", "", ""])[:4]
        tp, dp = map(int, mesh.split("x"))
        options = {"attn_impl": impl} if impl else {}
        options |= {"kv_cache_dtype": kv} if kv else {}
        # Blocks of decode steps never preempt, so they run with room in the pool.
        options |= {"decode_steps": int(steps), "num_pages": 48} if steps else {}
        cfg = engine_config(tp=tp, dp=dp, **options)
        t0 = time.perf_counter()
        engines = build_engines(model_cfg, cfg, model_dir=ckpt)
        engine = engines[0] if dp == 1 else ReplicaRouter(engines)
        built = time.perf_counter() - t0
        with count_compiles() as compiled:
            outs = run_workload(engine)
            jax.block_until_ready(engines[0].state)
        checked = (tp, dp) == (4, 1) or ((tp, dp) == (2, 1) and model_cfg.num_experts > 0)
        collectives = step_collectives(engines[0]) if checked else None
        tags = (impl, kv, steps and f"steps{steps}")
        results[f"tp{tp}_dp{dp}" + "".join(f"_{x}" for x in tags if x)] = {
            "collectives": collectives,
            "outputs": outs,
            "compiles_after_warmup": compiled,
            "replicas": [describe_engine(e) for e in engines],
            "routed": getattr(engine, "routed", [len(WORKLOAD)]),
            "swap_outs": sum(e.stats().swap_outs for e in engines),
            "steps": sum(e.stats().steps for e in engines),
            "dispatches": sum(e.stats().dispatches for e in engines),
            "build_seconds": round(built, 1),
            "run_seconds": round(time.perf_counter() - t0 - built, 1),
        }
        del engine, engines
    return results


class RssSampler:
    """Samples this process's current RSS (``/proc/self/statm``) every millisecond in a thread;
    ``peak`` is the highest seen. (``ru_maxrss`` is a lifetime high-water mark: a transient
    spike during start-up would hide the load's own peak.)"""

    def __init__(self):
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self.current()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def current(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.current())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def load_rss(ckpt: str, tp: int, naive: bool) -> dict:
    import jax

    from jbatch.models.config import ModelConfig
    from jbatch.parallel import load_params_sharded, make_mesh
    from jbatch.parallel.loading import params_bytes

    model_cfg = ModelConfig.from_file(os.path.join(ckpt, "config.json"))
    mesh = make_mesh(tp, 1)
    jax.block_until_ready(jax.device_put(0.0, jax.devices()[0]))  # start the runtime first
    t0 = time.perf_counter()
    with RssSampler() as rss:
        if naive:
            from jbatch.checkpoint import load_params
            from jbatch.parallel import shard_params

            params = shard_params(load_params(ckpt, model_cfg), model_cfg, mesh)
        else:
            params = load_params_sharded(ckpt, model_cfg, mesh)
        params = jax.block_until_ready(params)
    return {
        "rss_before": rss.start,
        "rss_peak": rss.peak,
        "params_bytes": params_bytes(params),
        "file_bytes": os.path.getsize(os.path.join(ckpt, "model.safetensors")),
        "seconds": round(time.perf_counter() - t0, 2),
        "wq_shard_shapes": describe(params["layers"]["wq"])["shard_shapes"],
    }


def multihost(ckpt: str, port: int, proc_id: int, nproc: int) -> dict:
    import jax

    from jbatch.parallel.distributed import initialize

    initialize(f"127.0.0.1:{port}", nproc, proc_id)
    from jbatch.models.config import ModelConfig
    from jbatch.parallel import build_engines

    model_cfg = ModelConfig.from_file(os.path.join(ckpt, "config.json"))
    tp = jax.device_count()
    (engine,) = build_engines(model_cfg, engine_config(tp=tp), model_dir=ckpt)
    outs = run_workload(engine)
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "tp": tp,
        "local_devices": jax.local_device_count(),
        "outputs": outs,
        "swap_outs": engine.stats().swap_outs,
        "kv": describe(engine.state.cache.k[0]),
    }


def stored(ckpt: str, directory: str) -> dict:
    """A tp=2 engine, then a dp=2 pair of one-device replicas, each built twice with the
    executable store in ``directory``: per build, what each replica's warm-up loaded, compiled
    and stored, its greedy workload and the compiles after warm-up."""
    import jax

    from jbatch.engine.executable_store import ExecutableStore
    from jbatch.models.config import ModelConfig
    from jbatch.parallel import build_engines
    from jbatch.parallel.router import ReplicaRouter
    from tests.compile_counter import count_compiles

    ExecutableStore.from_compilation_cache = classmethod(lambda cls: cls(directory))
    model_cfg = ModelConfig.from_file(os.path.join(ckpt, "config.json"))
    result = {}
    for tp, dp in ((2, 1), (1, 2)):
        runs = []
        for _ in range(2):
            engines = build_engines(model_cfg, engine_config(tp=tp, dp=dp), model_dir=ckpt)
            engine = engines[0] if dp == 1 else ReplicaRouter(engines)
            with count_compiles() as compiled:
                outs = run_workload(engine)
                jax.block_until_ready([e.state for e in engines])
            runs.append(dict(programs=[e.core.warmup_programs for e in engines], outputs=outs,
                             compiles_after_warmup=compiled))  # fmt: skip
        result[f"tp{tp}_dp{dp}"] = runs
    return result


def main(argv: list[str]) -> None:
    mode, args = argv[0], argv[1:]
    if mode == "matrix":
        result = matrix(args[0], args[1])
    elif mode == "load_rss":
        result = load_rss(args[0], int(args[1]), args[2:] == ["naive"])
    elif mode == "stored":
        result = stored(args[0], args[1])
    elif mode == "multihost":
        result = multihost(args[0], int(args[1]), int(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
