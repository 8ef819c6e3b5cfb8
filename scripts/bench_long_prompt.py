"""A 16k-token prompt amid a flood of short chats: its TTFT, and the chats' TPOT, per policy.

A random 2-layer Llama with a 17k-token context (``jbatch.tiny_model``), 8 slots, a 256-token
step budget. The long prompt (16 384 tokens, tenant ``analyst``) is prefilled in chunks: each
step it gets what the budget leaves after the decodes (``max_num_batched_tokens`` minus one
token per decoding slot), older running prompts first — so its chunk is ``256 - decodes``
tokens whatever its context (the chunk size does not shrink as the context grows).

Runs, for each of ``fcfs``, ``priority`` and ``fair`` (``--reps`` times each, medians):
* ``idle``: the long prompt alone — its TTFT;
* ``flood``: short chats (16 prompt tokens, 32 output tokens, 8 tenants) arriving at ``--rate``
  (0.4) per step for ``--flood-steps`` (200) steps (at 0.4, more than 8 slots serve: a backlog
  builds) — their TPOT p99;
* ``flood_long``: the same flood with the long prompt arriving at step ``--long-at`` (150; a
  backlog of chats is waiting by then);
* ``flood_long_paced``: the same with ``prefill_pacing=--pacing`` (``engine/prefill_pacer.py``:
  the long prompt's chunks take at most that share of the decoding chats' own time).

    PYTHONPATH=. python scripts/bench_long_prompt.py --out docs/bench_long_prompt.json

With the defaults the chats stop arriving at step 200, while the long prompt is still being
prefilled, and a policy that admits it later (fcfs, priority: behind the backlog) prefills it
beside fewer arrivals. A flood that outlasts the prefill, at a rate the slots can serve
(``--rate 0.2 --flood-steps N``, N past ``long_first_token_step``), leaves that out.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jbatch import LLM, SamplingParams
from jbatch.tiny_model import write_random_llama

LONG = 16_384


def run(eng, rng, flood: tuple[int, float] | None, long_at: int | None) -> dict:
    """``flood``: (steps, chats per step), or None for none."""
    arrivals: dict[int, list] = {}
    if flood:
        steps, rate = flood
        for step in range(steps):
            if rng.random() < rate:
                prompt = rng.integers(3, 2048, 16).tolist()
                arrivals.setdefault(step, []).append((prompt, 32, f"chat{step % 8}"))
    if long_at is not None:
        arrivals.setdefault(long_at, []).append(
            (rng.integers(3, 2048, LONG).tolist(), 4, "analyst")
        )
    done, long_id, step, t0, extra = {}, None, 0, time.monotonic(), {}
    while arrivals or eng.has_unfinished_requests():
        for prompt, n, tenant in arrivals.pop(step, []):
            p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            rid = eng.add_request(prompt, p, tenant=tenant)
            if tenant == "analyst":
                long_id = rid
        for out in eng.step():
            if out.request_id == long_id and "long_first_token_step" not in extra:
                extra["long_first_token_step"] = step
            if out.finished:
                done[out.request_id] = (
                    time.monotonic(),
                    out.metrics,
                    len(eng.requests[out.request_id].output_ids),
                )
        step += 1
    result = {"steps": step, "seconds": time.monotonic() - t0, **extra}
    tpot = [
        (t - m["first_token_time"]) / (n - 1) for rid, (t, m, n) in done.items() if rid != long_id
    ]
    if tpot:
        result["chat_tpot_p99_ms"] = 1e3 * float(np.percentile(tpot, 99))
        result["chat_tpot_p50_ms"] = 1e3 * float(np.median(tpot))
        ttft = [m["first_token_time"] - m["arrival_time"] for rid, (_, m, _) in done.items()
                if rid != long_id]  # fmt: skip
        result["chat_ttft_p99_ms"] = 1e3 * float(np.percentile(ttft, 99))
    if long_id is not None:
        m, seq = done[long_id][1], eng.requests[long_id]
        result["long_ttft_s"] = m["first_token_time"] - m["arrival_time"]
        result["long_wait_steps"] = seq.first_scheduled_step - seq.waiting_since  # for a slot
    eng.forget_finished()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/bench_long_prompt.json")
    ap.add_argument("--pacing", type=float, default=0.3, help="prefill_pacing of the paced run")
    ap.add_argument("--reps", type=int, default=3, help="runs per cell (medians reported)")
    ap.add_argument("--flood-steps", type=int, default=200, help="steps during which chats arrive")
    ap.add_argument("--rate", type=float, default=0.4, help="chat arrivals per step")
    ap.add_argument("--long-at", type=int, default=150, help="the long prompt's arrival step")
    args = ap.parse_args()
    model = write_random_llama(
        "/tmp/jbatch-long-llama", vocab_size=2048, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=17_408,
        tokenizer=False,
    )  # fmt: skip
    llm = LLM(
        model, max_slots=8, page_size=16, num_pages=1120, max_num_batched_tokens=256,
        max_seq_len=16_896,
    )  # fmt: skip
    eng, results = llm.engine, {}
    for policy in ("fcfs", "priority", "fair"):
        r = {}
        flood = (args.flood_steps, args.rate)
        for name, chats, long_at, pacing in (
            ("idle", None, 0, None),
            ("flood", flood, None, None),
            ("flood_long", flood, args.long_at, None),
            ("flood_long_paced", flood, args.long_at, args.pacing),
        ):
            reps = []
            for _ in range(args.reps):  # a fresh scheduler each: no prefix-cache hits
                eng.set_policies(scheduling_policy=policy, prefill_pacing=pacing)
                reps.append(run(eng, np.random.default_rng(0), chats, long_at))
            r[name] = {k: float(np.median([x[k] for x in reps])) for k in reps[0]}  # medians
            r[name]["reps"] = reps
            print(policy, name, {k: v for k, v in r[name].items() if k != "reps"}, flush=True)
        for run_name in ("flood_long", "flood_long_paced"):
            tag = run_name.removeprefix("flood_long")
            r["ttft_vs_idle" + tag] = r[run_name]["long_ttft_s"] / r["idle"]["long_ttft_s"]
            r["tpot_p99_vs_flood" + tag] = (
                r[run_name]["chat_tpot_p99_ms"] / r["flood"]["chat_tpot_p99_ms"]
            )
        results[policy] = r
    with open(args.out, "w") as f:
        meta = {"date": time.strftime("%Y-%m-%d"), **vars(args)}
        json.dump({**meta, "results": results}, f, indent=1)
    print(json.dumps({p: {k: v for k, v in r.items() if "vs" in k} for p, r in results.items()}))


if __name__ == "__main__":
    main()
