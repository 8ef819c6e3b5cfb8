"""Disaggregation checks on simulated CPU devices, run in a subprocess (like
``tests/parallel_worker.py``): ``python -m tests.disagg_worker inprocess CKPT`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` prints ``RESULT {json}`` last.

``inprocess``: 64 requests (random lengths, shared prefixes, some FINAL and some DELTA outputs,
some ending with their first token) through a mixed engine on devices 0-3 (tp=4), then through
a DisaggregatedEngine: prefill tp=4 on devices 0-3, decode tp=4 on 4-7 with a small pool (swap
preemptions); each request's tokens, compilations after warm-up, page counts at the end.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

NUM_REQUESTS = 64


def configs():
    from jbatch.engine.config import EngineConfig

    base = dict(
        max_slots=8, page_size=4, max_num_batched_tokens=32, block_q=8, max_seq_len=64, tp=4,
        debug_checks=True,
    )  # fmt: skip
    mixed = EngineConfig(**base, num_pages=96)
    prefill = EngineConfig(**base, num_pages=64, role="prefill")
    decode = EngineConfig(**base, num_pages=24, role="decode")  # 8 slots of up to 14 pages
    return mixed, prefill, decode


def workload(seed: int = 0) -> list[tuple[list[int], int, int, bool]]:
    """(prompt, max_tokens, arrival step, final output) per request."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 384) for _ in range(16)] for _ in range(3)]
    out = []
    for i in range(NUM_REQUESTS):
        tail = [rng.randrange(3, 384) for _ in range(rng.randrange(1, 24))]
        prompt = (prefixes[i % 3] if i % 2 else []) + tail
        max_tokens = 1 if i % 16 == 5 else rng.randrange(2, 20)
        out.append((prompt, max_tokens, i // 2, i % 4 == 1))
    return out


def run(engine, requests) -> dict[str, list[int]]:
    """Feed ``requests`` as they arrive; each request's tokens (DELTA outputs concatenated)."""
    from jbatch.outputs import OutputKind
    from jbatch.sampling_params import SamplingParams

    tokens: dict[str, list[int]] = {}
    done: set[str] = set()
    pending = list(enumerate(requests))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, final) = pending.pop(0)
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            kind = OutputKind.FINAL if final else OutputKind.DELTA
            engine.add_request(prompt, sp, request_id=f"q{i}", output_kind=kind)
        for out in engine.step():
            assert out.request_id not in done, f"output after the end for {out.request_id}"
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                done.add(out.request_id)
                engine.forget(out.request_id)
        step += 1
        if step > 3000:
            raise RuntimeError("workload did not finish")
    assert len(done) == len(requests), f"{len(done)} of {len(requests)} finished"
    return tokens


def inprocess(ckpt: str) -> dict:
    import jax

    from jbatch.models.config import ModelConfig
    from jbatch.parallel import build_engines
    from jbatch.parallel.disaggregated import build_disaggregated
    from tests.compile_counter import count_compiles

    model_cfg = ModelConfig.from_file(os.path.join(ckpt, "config.json"))
    mixed_cfg, prefill_cfg, decode_cfg = configs()
    requests = workload()
    devices = jax.devices()
    (mixed,) = build_engines(model_cfg, mixed_cfg, model_dir=ckpt, devices=devices[:4])
    expected = run(mixed, requests)
    del mixed
    t0 = time.perf_counter()
    engine = build_disaggregated(model_cfg, prefill_cfg, decode_cfg, model_dir=ckpt)
    built = time.perf_counter() - t0
    with count_compiles() as compiled:
        t0 = time.perf_counter()
        got = run(engine, requests)
        jax.block_until_ready([engine.prefill.state, engine.decodes[0].state])
        ran = time.perf_counter() - t0
    sides = {"prefill": engine.prefill, "decode": engine.decodes[0]}
    for side in sides.values():
        side.scheduler.check_invariants()
    return {
        "expected": expected,
        "outputs": got,
        "compiles_after_warmup": compiled,
        "handovers": engine.handovers,
        "programs": {k: sorted(map(list, e.core.layouts)) for k, e in sides.items()},
        "programs_run": {k: sorted(map(list, e.core.programs_run)) for k, e in sides.items()},
        "pages_used": {k: e.scheduler.allocator.num_used for k, e in sides.items()},
        "slots_free": {k: len(e.scheduler.free_slots) for k, e in sides.items()},
        "requests_left": {k: len(e.requests) for k, e in sides.items()},
        "prefix_hits": {k: e.stats().prefix_cache_hits for k, e in sides.items()},
        "swap_outs": {k: e.stats().swap_outs for k, e in sides.items()},
        "kv_devices": {k: _devices(e.state.cache.k[0]) for k, e in sides.items()},
        "build_seconds": round(built, 1),
        "run_seconds": round(ran, 1),
    }


def _devices(arr) -> list[int]:
    return sorted(d.id for d in arr.sharding.device_set)


def main(argv: list[str]) -> None:
    mode, args = argv[0], argv[1:]
    if mode == "inprocess":
        result = inprocess(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
