"""Fair share between tenants: fcfs vs fair on the MockCore (scheduling is host-side; time is
counted in engine steps, service in weighted tokens ``W_IN * prompt + W_OUT * output``).

Scenarios (three tenants; A sends 10x the requests of B and C):
* ``flood``: all requests queued at once, interleaved 10:1:1 — per-tenant service over time
  while all are backlogged, Jain's index of normalized service, the largest gap between two
  tenants' normalized service vs the bound ``slots * C / w_min`` (tests/test_fair_share.py);
* ``weighted``: the same under ``fair`` with weights A:B:C = 2:1:1;
* ``idle_return``: A and B always backlogged, C sends for a while, goes idle, comes back
  (fcfs, fair, and fair without the lift of a returning tenant's counter);
* ``light``: A floods 400 requests of mixed lengths, B and C send one request at a time: their
  mean latency (steps, arrival to last token) vs an idle engine;
* ``overhead``: ``Scheduler.schedule()`` time per step with a 10 000-request backlog over 1 000
  tenants (64 slots, 512-token budget), per policy.

    PYTHONPATH=. python scripts/bench_fairness.py --out docs/bench_fairness.json \
        --plot docs/bench_fairness.png
"""

from __future__ import annotations

import argparse
import json
import time
import types

import numpy as np

from jbatch import EngineConfig, LLMEngine, SamplingParams
from jbatch.engine.mock_core import MockCore
from jbatch.engine.tenants import W_IN, W_OUT

VOCAB = 97
TENANTS = ("A", "B", "C")


def engine(policy: str, weights=None, **kw) -> LLMEngine:
    base = dict(max_slots=8, page_size=4, num_pages=1024, max_seq_len=64, block_q=4)
    base.update(max_num_batched_tokens=32, scheduling_policy=policy)
    cfg = EngineConfig(**{**base, "tenant_weights": weights or {}, **kw})
    return LLMEngine(
        types.SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20),
        None,
        cfg,
        core=MockCore(cfg, VOCAB),
    )


def add(eng, rng, tenant, max_prompt=16, max_out=16) -> str:
    prompt = rng.randint(3, VOCAB, rng.randint(4, max_prompt + 1)).tolist()
    p = SamplingParams(temperature=0.0, max_tokens=int(rng.randint(4, max_out + 1)))
    return eng.add_request(prompt, p.replace(ignore_eos=True), tenant=tenant)


def normalized(eng) -> dict[str, float]:
    weights = dict(eng.cfg.tenant_weights)
    return {t: s.service / weights.get(t, 1.0) for t, s in eng.stats().tenants.items()}


def jain(x) -> float:
    x = np.asarray(x, float)
    return float(x.sum() ** 2 / (len(x) * (x**2).sum()))


def flood(policy: str, weights=None, rounds: int = 60) -> dict:
    eng, rng = engine(policy, weights), np.random.RandomState(0)
    for _ in range(rounds):
        for tenant in ("A",) * 10 + ("B", "C"):
            add(eng, rng, tenant)
    trace = []
    while all(eng.stats().tenants[t].waiting for t in TENANTS):
        eng.step()
        trace.append(normalized(eng))
    final = trace[-1]
    served = {t: s.service for t, s in eng.stats().tenants.items()}
    bound = eng.cfg.max_slots * (W_IN * 16 + W_OUT * 16) / min([1.0, *dict(weights or {}).values()])
    return {
        "policy": policy,
        "weights": dict(weights or {}),
        "steps_backlogged": len(trace),
        "service": served,
        "share": {t: served[t] / sum(served.values()) for t in TENANTS},
        "jain_index_normalized": jain([final[t] for t in TENANTS]),
        "max_gap_normalized": max(max(s.values()) - min(s.values()) for s in trace),
        "bound": bound,
        "series": {t: [round(s[t], 1) for s in trace] for t in TENANTS},
    }


def idle_return(policy: str, steps: int = 900, away=(300, 600)) -> dict:
    """A and B keep 20 requests waiting; C keeps 20 waiting except during ``away``.
    ``fair_no_lift``: ``fair`` without lifting a returning tenant's counter (what the lift
    prevents: C's burst while it catches up)."""
    no_lift = policy == "fair_no_lift"
    eng, rng = engine("fair" if no_lift else policy), np.random.RandomState(1)
    if no_lift:
        eng.scheduler.ledger.lift = lambda tenant, floor: None
    series = {t: [] for t in TENANTS}
    for step in range(steps):
        waiting = {t: s.waiting for t, s in eng.stats().tenants.items()}
        for t in TENANTS:
            if t == "C" and away[0] <= step < away[1]:
                continue
            for _ in range(20 - waiting.get(t, 0)):
                add(eng, rng, t)
        eng.step()
        for t, v in normalized(eng).items():
            series[t].append(v)
    window = slice(away[1], away[1] + 100)  # the 100 steps after C's return
    gained = {t: series[t][window.stop] - series[t][window.start] for t in TENANTS}
    return {
        "policy": policy,
        "away_steps": list(away),
        "service_in_100_steps_after_return": gained,
        "share_of_C_after_return": gained["C"] / sum(gained.values()),
        "series": {t: [round(v, 1) for v in s] for t, s in series.items()},
    }


def light(policy: str, flood_size: int = 400) -> dict:
    def one_at_a_time(eng, rng, flood_ids=(), sends=20):
        start, latencies, current, step = {}, [], {}, 0
        while True:
            flooding = any(not eng.requests[r].finished for r in flood_ids)
            for t in ("B", "C"):
                rid = current.get(t)
                if rid is not None and eng.requests[rid].finished:
                    latencies.append(step - start.pop(rid))
                    current[t] = rid = None
                if rid is None and (flooding or (not flood_ids and len(latencies) < 2 * sends)):
                    rid = current[t] = add(eng, rng, t, 8, 16)
                    start[rid] = step
            if not eng.has_unfinished_requests():
                return latencies
            eng.step()
            step += 1

    idle = one_at_a_time(engine(policy), np.random.RandomState(2))
    eng, rng = engine(policy), np.random.RandomState(3)
    ids = [add(eng, rng, "A", 32, 32) for _ in range(flood_size)]
    busy = one_at_a_time(eng, np.random.RandomState(2), ids)
    assert all(eng.requests[r].finish_reason == "length" for r in ids)
    return {
        "policy": policy,
        "idle_mean_latency_steps": float(np.mean(idle)),
        "flood_mean_latency_steps": float(np.mean(busy)),
        "ratio": float(np.mean(busy) / np.mean(idle)),
        "light_requests_served": len(busy),
    }


def overhead(policy: str, backlog: int = 10_000, tenants: int = 1_000, steps: int = 200) -> dict:
    eng = engine(policy, max_slots=64, max_num_batched_tokens=512, num_pages=8192)
    rng = np.random.RandomState(4)
    for i in range(backlog):
        add(eng, rng, f"t{i % tenants}")
    sched, spent = eng.scheduler, []
    schedule = sched.schedule

    def timed():
        t0 = time.perf_counter()
        out = schedule()
        spent.append(time.perf_counter() - t0)
        return out

    sched.schedule = timed
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = time.perf_counter() - t0
    return {
        "policy": policy,
        "backlog": backlog,
        "tenants": tenants,
        "schedule_ms_per_step_mean": 1e3 * float(np.mean(spent)),
        "schedule_ms_per_step_median": 1e3 * float(np.median(spent)),
        "schedule_ms_per_step_p99": 1e3 * float(np.percentile(spent, 99)),
        "engine_step_ms_mean": 1e3 * wall / steps,
        "still_waiting": eng.stats().waiting,
    }


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (results["flood"]["fcfs"], "fcfs: A sends 10x"),
        (results["flood"]["fair"], "fair: A sends 10x"),
        (results["weighted"], "fair, weights A:B:C = 2:1:1"),
    ]
    for ax, (r, title) in zip(axes.flat, panels):
        for t in TENANTS:
            ax.plot(r["series"][t], label=f"{t} (share {r['share'][t]:.2f})")
        ax.set(title=title, xlabel="engine step", ylabel="weighted tokens served / weight")
        ax.legend()
    ax = axes.flat[3]
    for policy, style in (("fair_no_lift", ":"), ("fair", "-")):
        series = results["idle_return"][policy]["series"]
        for t in TENANTS:
            rate = np.diff(series[t], prepend=0.0)
            smooth = np.convolve(rate, np.ones(25) / 25, mode="same")
            ax.plot(smooth, style, label=f"{t} {policy}")
    away = results["idle_return"]["fair"]["away_steps"]
    ax.axvspan(*away, color="0.9")
    ax.set(title="C idle (grey) and back", xlabel="engine step", ylabel="service per step")
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/bench_fairness.json")
    ap.add_argument("--plot", default="docs/bench_fairness.png")
    args = ap.parse_args()
    results = {
        "flood": {p: flood(p) for p in ("fcfs", "priority", "fair")},
        "weighted": flood("fair", {"A": 2}, rounds=120),
        "idle_return": {p: idle_return(p) for p in ("fcfs", "fair", "fair_no_lift")},
        "light": {p: light(p) for p in ("fcfs", "fair")},
        "overhead": {p: overhead(p) for p in ("priority", "fcfs", "fair")},
    }
    summary = {
        "flood": {
            p: {k: v for k, v in r.items() if k != "series"} for p, r in results["flood"].items()
        },
        "weighted": {k: v for k, v in results["weighted"].items() if k != "series"},
        "idle_return": {
            p: {k: v for k, v in r.items() if k != "series"}
            for p, r in results["idle_return"].items()
        },
        "light": results["light"],
        "overhead": results["overhead"],
    }
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump(results, f)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
