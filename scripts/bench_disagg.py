"""Disaggregation costs: bytes one handover moves, how long moving them takes (a device copy
between two device groups in one process, and JAX's transfer server as between two serving
processes), and the gap between a request's first token (prefill engine) and second token
(decode engine) compared with a mixed engine. Also checks that a pulled slot is swapped in
without compiling anything.

    PYTHONPATH=. XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python scripts/bench_disagg.py [--model DIR] [--prompt-lens 16,128,512]

On CPU "devices" are threads of one host: the numbers are host memcpy and loopback socket
costs, a floor for what a real interconnect adds, not a measurement of one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jbatch.demo import demo_model_path
from jbatch.engine import buckets
from jbatch.engine.config import EngineConfig
from jbatch.models.config import ModelConfig
from jbatch.parallel import build_engines
from jbatch.parallel.disaggregated import build_disaggregated
from jbatch.sampling_params import SamplingParams
from serving.kv_transfer import KvTransfer
from tests.compile_counter import count_compiles


def median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def slot_costs(engine, pages: int, transfer_a: KvTransfer, transfer_b: KvTransfer) -> dict:
    """The copy of a handover of ``pages`` pages: its bytes, the device copy, the pull."""
    prefill, decode = engine.prefill, engine.decodes[0]
    n = buckets.pick_handover_bucket(prefill.cfg, pages)
    unused = prefill.core.unused_pages()
    prefill.state, saved = prefill.core.swap_out(prefill.state, 0, unused, n)
    saved = jax.block_until_ready(saved)
    leaves = jax.tree.leaves(saved)
    kv_bytes = sum(a.nbytes for a in jax.tree.leaves(saved.kv))
    template = jax.eval_shape(lambda s: s, saved)

    def pull():
        uuid, specs = transfer_a.offer(saved)
        placement = decode.core.swapped_sharding
        return transfer_b.pull(transfer_a.address, uuid, specs, template, placement)

    pulled = jax.block_until_ready(pull())
    with count_compiles() as compiled:  # what a decode server does with a pulled slot
        saved_b = decode.core.to_device(pulled)
        decode.state = decode.core.swap_in(decode.state, 0, decode.core.unused_pages(), saved_b)
        jax.block_until_ready(decode.state)
    return {
        "pages": n,
        "bytes": sum(a.nbytes for a in leaves),
        "kv_bytes_per_token": kv_bytes // (n * prefill.cfg.page_size),
        "device_copy_ms": median_ms(lambda: decode.core.to_device(saved)),
        "transfer_pull_ms": median_ms(pull),
        "compiles_on_swap_in": compiled,
    }


def token_gaps(engine, prompt_len: int, n: int = 8) -> float:
    """Median ms between a request's first and second token (greedy, ``n`` at once)."""
    rng = np.random.default_rng(prompt_len)
    first, gaps = {}, []
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(n):
        engine.add_request(rng.integers(3, 1000, prompt_len).tolist(), sp, request_id=f"g{i}")
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            got = out.outputs[0].num_tokens
            if got == 1:
                first[out.request_id] = now
            elif got == 2:
                gaps.append(now - first[out.request_id])
            if out.finished:
                engine.forget(out.request_id)
    return 1e3 * statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(demo_model_path()))
    parser.add_argument("--prompt-lens", default="16,128,512")
    args = parser.parse_args()
    model_cfg = ModelConfig.from_file(f"{args.model}/config.json")
    base = dict(max_slots=8, page_size=16, max_seq_len=1024, max_num_batched_tokens=256)
    cfgs = {role: EngineConfig(**base, num_pages=256, role=role) for role in ("prefill", "decode")}
    devices = jax.devices()
    engine = build_disaggregated(model_cfg, cfgs["prefill"], cfgs["decode"], model_dir=args.model)
    (mixed,) = build_engines(
        model_cfg, EngineConfig(**base, num_pages=256), model_dir=args.model, devices=devices[:1]
    )
    transfers = KvTransfer(), KvTransfer()
    print(f"devices: {[str(d) for d in devices]}; model {args.model}; {base}")
    for n in map(int, args.prompt_lens.split(",")):
        c = slot_costs(engine, -(-n // base["page_size"]), *transfers)
        gap_d, gap_m = token_gaps(engine, n), token_gaps(mixed, n)
        print(
            f"prompt {n:4d}: {c['pages']} pages, {c['bytes'] / 1024:.0f} KiB moved "
            f"({c['bytes'] / n:.0f} B per prompt token, {c['kv_bytes_per_token']} KV B/token); "
            f"device copy {c['device_copy_ms']:.2f} ms, transfer-server pull (loopback) "
            f"{c['transfer_pull_ms']:.2f} ms; compiles on swap-in of a pulled copy: "
            f"{len(c['compiles_on_swap_in'])}; first->second token {gap_d:.1f} ms "
            f"disaggregated vs {gap_m:.1f} ms mixed"
        )


if __name__ == "__main__":
    main()
