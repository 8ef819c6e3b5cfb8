"""Host time per engine step, dispatches per step, and O(1) host work per token.

    python scripts/bench_host.py [--slots 32] [--decode-steps 1 4 8] [--out docs/bench_host]

Three measurements (prints tables, writes OUT.json and OUT.png):
1. **Demo model, ``--slots`` slots**, per ``EngineConfig.decode_steps`` value (blocks of decode
   steps per dispatch; 1: off), a long-tail workload through ``LLMEngine.step()``: wall time
   per step, host time per step (``step()`` wall time minus the time it blocked on device
   results, ``EngineStats.host_only_seconds``) and its share of the step, of it the time inside
   the jitted calls that launch steps (``EngineStats.dispatch_seconds``: JAX/XLA preparing each
   execution), jitted dispatches per step (``EngineStats.dispatches``; 1 = the one step
   program, swaps add their own; a block of decode steps is one dispatch for several steps),
   and what the host's work costs the run: the run's step programs replayed back to back with
   no host work between them (``dispatch_replay.py``), host cost = 1 - replay / run wall (the
   median over the runs; the other columns: the run of median throughput). With async
   scheduling the host share counts work done while the device runs; the cost does not.
2. **Continuous vs static batching** on a random 2-layer, 64-wide Llama (vocab 384): 256
   requests through 8 slots, 10% with 256-512 output tokens, the rest 4-32
   (``bench_batching.py``'s workload and runner), against the step-count ceiling: ``--reps``
   static and continuous runs interleaved on one engine, the ratio of their median walls.
3. **Host cost per token vs generation length** on the numpy ``MockCore`` (no device work):
   8 slots busy with 4 000-token generations vs with 40-token ones, host microseconds per token.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_batching import ideal_steps, make_workload, run
from bench_report import write_summary
from dispatch_replay import DispatchRecorder, replay

from jbatch import LLM, SamplingParams
from jbatch.demo import demo_model_path
from jbatch.engine.config import EngineConfig
from jbatch.engine.llm_engine import LLMEngine
from jbatch.engine.mock_core import MockCore
from jbatch.tiny_model import write_random_llama


def demo_engine(slots: int, decode_steps: int) -> LLM:
    return LLM(
        str(demo_model_path()), max_slots=slots, num_pages=2048, max_seq_len=512,
        max_num_batched_tokens=256, decode_steps=decode_steps,
    )  # fmt: skip


def demo_host_time(llm: LLM, requests: int, seed: int) -> dict:
    eng = llm.engine
    slots = eng.cfg.max_slots
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 500, rng.integers(16, 64)).tolist() for _ in range(requests)]
    lens = np.clip(rng.lognormal(np.log(48), 0.8, requests), 8, 400).astype(int)
    params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in lens]
    llm.generate(prompts[:slots], params[:slots], use_tqdm=False)  # warm caches and the pool
    before = eng.stats()
    with DispatchRecorder(eng) as recorded:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    after = eng.stats()
    replayed, _ = replay(eng, recorded)  # the same device work, no host between
    steps = after.steps - before.steps
    host = after.host_only_seconds - before.host_only_seconds
    dispatch = after.dispatch_seconds - before.dispatch_seconds
    return {
        "slots": slots,
        "decode_steps": eng.cfg.decode_steps,
        "requests": requests,
        "output_tokens": int(lens.sum()),
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "host_ms_per_step": 1e3 * host / steps,
        "host_share_of_step": host / wall,
        "replay_ms_per_step": 1e3 * replayed / steps,
        "host_cost_share": 1 - replayed / wall,
        "dispatch_ms_per_step": 1e3 * dispatch / steps,
        "dispatches_per_step": (after.dispatches - before.dispatches) / steps,
        "admission_blocks": after.admission_blocks - before.admission_blocks,
        "tok_per_s": int(lens.sum()) / wall,
    }


def demo_runs(slots: int, requests: int, seed: int, decode_steps: list[int], reps: int):
    """One engine per ``decode_steps`` value, their runs interleaved ``reps`` times; per value
    the run with the median throughput (and every run)."""
    engines = {n: demo_engine(slots, n) for n in decode_steps}
    runs: dict[int, list[dict]] = {n: [] for n in decode_steps}
    for _ in range(reps):
        for n, llm in engines.items():
            runs[n].append(demo_host_time(llm, requests, seed))
    median = lambda rs: sorted(rs, key=lambda r: r["tok_per_s"])[len(rs) // 2]
    # One run and its replay vary by +-10% on a noisy machine: the cost's median over the runs.
    cost = lambda rs: float(np.median([r["host_cost_share"] for r in rs]))
    return [dict(median(rs), runs=rs, host_cost_median=cost(rs)) for rs in runs.values()]


def continuous_vs_static(seed: int, reps: int) -> dict:
    """Static and continuous runs interleaved ``reps`` times on one warmed engine; the speedup
    is the ratio of the median walls (each run's wall, steps and host share are kept)."""
    model = write_random_llama(
        "/tmp/jbatch-bench-2x64", vocab_size=384, hidden_size=64, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, tokenizer=False,
    )  # fmt: skip
    llm = LLM(model, max_slots=8, num_pages=1024, max_num_batched_tokens=256, max_seq_len=1024)
    args = argparse.Namespace(
        requests=256, long_frac=0.1, long_min=256, long_max=512, short_min=4, short_max=32,
        prompt_min=8, prompt_max=64, seed=seed, vocab=384,
    )  # fmt: skip
    prompts, out_lens = make_workload(args)
    for static in (False, True):  # warm-up: every bucket either mode uses
        run(llm, prompts[:16], out_lens[:16], static=static)
    runs: dict[str, list[dict]] = {"static": [], "continuous": []}
    for _ in range(reps):
        for mode, r in runs.items():
            r.append(run(llm, prompts, out_lens, static=(mode == "static")))
            r[-1].pop("timeline")
    wall = {m: float(np.median([r["wall_s"] for r in rs])) for m, rs in runs.items()}
    ideal_static, ideal_cont = ideal_steps(out_lens, 8)
    return {
        "speedup": wall["static"] / wall["continuous"],
        "per_rep": [s["wall_s"] / c["wall_s"] for s, c in zip(runs["static"], runs["continuous"])],
        "ideal": ideal_static / ideal_cont,
        "median_wall_s": wall,
        "results": runs,
    }


def per_token_cost() -> dict:
    """Host microseconds per generated token: one long generation vs many short ones."""
    cfg = EngineConfig(max_slots=8, page_size=16, num_pages=2100, max_seq_len=4096)

    def run_mock(prompts: int, tokens: int) -> float:
        model_cfg = argparse.Namespace(vocab_size=1000, max_position_embeddings=cfg.max_seq_len)
        eng = LLMEngine(model_cfg, None, cfg, eos_token_ids=(2,), core=_FreeMock(cfg, 1000))
        for i in range(prompts):
            eng.add_request([5 + i, 6], SamplingParams(max_tokens=tokens, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    eng.forget(out.request_id)
        return 1e6 * (time.perf_counter() - t0) / (prompts * tokens)

    # Both keep all 8 slots busy: 800 requests of 40 tokens vs 8 of 4 000.
    short = float(np.median([run_mock(800, 40) for _ in range(3)]))
    long = float(np.median([run_mock(8, 4000) for _ in range(3)]))
    return {"us_per_token_40": short, "us_per_token_4000": long, "ratio": long / short}


class _FreeMock(MockCore):
    """A MockCore whose "model" costs nothing: O(1) per token (the real mock re-reads the whole
    sequence each step), so only the engine's own host work is timed."""

    def _step(self, st, b, bitmask=None):
        s = self.cfg.max_slots
        for slot, idx, page in zip(b.write_slots, b.write_index, b.write_pages):
            if slot < s:
                st.page_tables[slot, idx] = page
        listed = np.zeros(s + 1, bool)
        listed[np.asarray(b.decode_slots)] = True
        decode = st.active & (st.seq_lens >= st.prefill_lens) & (st.num_generated < st.max_tokens)
        decode &= listed[:s]
        sampled = decode.copy()
        for slot, pos in zip(b.prefill_slots, b.prefill_positions):
            if pos >= 0:
                st.seq_lens[slot] = max(st.seq_lens[slot], pos + 1)
                sampled[slot] |= pos == st.prefill_lens[slot] - 1
        st.seq_lens[decode] += 1
        new = np.where(sampled, 3 + (st.seq_lens * 7) % 900, 0)
        st.tokens = np.where(sampled, new, st.tokens)
        st.num_generated += sampled
        out = argparse.Namespace(tokens=new, sampled=sampled, logprobs=np.zeros(s))
        return st, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[1, 4, 8],
                    help="EngineConfig.decode_steps values of the demo runs")  # fmt: skip
    ap.add_argument("--demo-reps", type=int, default=1, help="interleaved demo runs per value")
    ap.add_argument("--reps", type=int, default=5, help="interleaved static/continuous pairs")
    ap.add_argument("--out", default="docs/bench_host")
    args = ap.parse_args()
    demo = demo_runs(args.slots, args.requests, args.seed, args.decode_steps, args.demo_reps)
    batching = continuous_vs_static(args.seed, args.reps)
    tokens = per_token_cost()
    print(f"\n1. demo model, {args.slots} slots, {args.requests} long-tail requests "
          f"(median of {args.demo_reps} interleaved runs)")  # fmt: skip
    print(f"{'decode_steps':>12} {'wall ms/step':>13} {'host ms/step':>13} {'of it, dispatch':>16} "
          f"{'host share':>11} {'replay ms/step':>15} {'host cost':>10} {'dispatches/step':>16} "
          f"{'tok/s':>8}")  # fmt: skip
    for d in demo:
        print(
            f"{d['decode_steps']:12d} {d['wall_ms_per_step']:13.2f} {d['host_ms_per_step']:13.3f} "
            f"{d['dispatch_ms_per_step']:16.3f} {d['host_share_of_step']:11.1%} "
            f"{d['replay_ms_per_step']:15.2f} {d['host_cost_median']:10.1%} "
            f"{d['dispatches_per_step']:16.2f} {d['tok_per_s']:8.0f}"
        )
    print("\n2. 2-layer 64-wide Llama, 256 requests, 8 slots (10% 256-512 tokens, rest 4-32), "
          f"{args.reps} interleaved runs each")  # fmt: skip
    for mode, rs in batching["results"].items():
        wall = batching["median_wall_s"][mode]
        steps, host = rs[0]["steps"], np.median([r["host_overhead_pct"] for r in rs])
        ms = 1e3 * wall / steps
        line = f"median {wall:6.2f} s  {steps} steps  {ms:.3f} ms/step  host {host:.0f}%"
        print(f"   {mode:<11} {line}")
    per_rep = " / ".join(f"{x:.2f}" for x in batching["per_rep"])
    print(f"   continuous / static = {batching['speedup']:.2f}x of the medians (pairs: {per_rep}; "
          f"ceiling {batching['ideal']:.2f}x)")  # fmt: skip
    print("\n3. host us per token (MockCore): "
          f"40-token requests {tokens['us_per_token_40']:.1f}, 4000-token requests "
          f"{tokens['us_per_token_4000']:.1f} (ratio {tokens['ratio']:.2f})")  # fmt: skip
    out = write_summary(args.out, demo=demo, continuous_vs_static=batching, per_token=tokens)
    plot(demo, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(demo: list[dict], path: Path) -> None:
    """Host share of the step and throughput per ``decode_steps`` value (demo model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(d["decode_steps"]) for d in demo]
    fig, (share, tput) = plt.subplots(1, 2, figsize=(9, 3.5))
    x, w = np.arange(len(demo)), 0.4
    share.bar(x - w / 2, [100 * d["host_share_of_step"] for d in demo], w, label="host share")
    cost = [100 * d["host_cost_median"] for d in demo]
    share.bar(x + w / 2, cost, w, label="host cost (replay, median)")
    share.axhline(10, color="gray", linestyle="--", label="target 10%")
    share.set(xticks=x, xticklabels=labels, xlabel="decode_steps", ylabel="% of the run",
              title="host time")  # fmt: skip
    share.legend()
    tput.bar(labels, [d["tok_per_s"] for d in demo], color="tab:blue")
    tput.set(xlabel="decode_steps", ylabel="output tokens/s", title="throughput")
    fig.suptitle(f"demo model, {demo[0]['slots']} slots, {demo[0]['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
