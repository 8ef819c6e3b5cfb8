"""Fair share between tenants (``scheduling_policy="fair"``) on the MockCore: the virtual token
counter bound at every step, weighted shares, no burst for a returning tenant, light tenants
unhurt by a flood — and ``fcfs`` failing the same checks (so each check can fail).

The bound asserted (all tenants backlogged from the start, no preemption): for any two tenants
f, g at every step, ``S_f / w_f - S_g / w_g <= slots * C / w_min``, where ``S`` is the weighted
service received (``W_IN * prompt tokens computed + W_OUT * output tokens``) and ``C`` the
largest cost of one request (``W_IN * longest prompt + W_OUT * longest output``). Why: f is
only admitted while its counter is the smallest; after its last admission its counter grows
only by the requests it then holds (at most ``slots`` of them), while the smallest counter
never decreases. (The paper's bound has the same shape: what can be in flight for one tenant.)
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from jbatch import EngineConfig, LLMEngine, SamplingParams
from jbatch.engine.mock_core import MockCore, expected_tokens
from jbatch.engine.tenants import W_IN, W_OUT

VOCAB = 97
SLOTS, MAX_PROMPT, MAX_OUT = 4, 12, 12
BOUND_C = W_IN * MAX_PROMPT + W_OUT * MAX_OUT


def engine(policy: str, weights=None, **kw) -> LLMEngine:
    cfg = EngineConfig(
        **{
            "max_slots": SLOTS,
            "page_size": 4,
            "num_pages": 256,
            "max_seq_len": 64,
            "max_num_batched_tokens": 16,
            "block_q": 4,
            "scheduling_policy": policy,
            "tenant_weights": weights or {},
            **kw,
        }
    )
    return LLMEngine(
        types.SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20),
        None,
        cfg,
        core=MockCore(cfg, VOCAB),
    )


def add(eng, rng, tenant, max_prompt=MAX_PROMPT, max_out=MAX_OUT) -> str:
    prompt = rng.randint(3, VOCAB, rng.randint(4, max_prompt + 1)).tolist()
    p = SamplingParams(
        temperature=0.0, max_tokens=int(rng.randint(4, max_out + 1)), ignore_eos=True
    )
    return eng.add_request(prompt, p, tenant=tenant)


def flood(eng, rounds: int, pattern=("A",) * 10 + ("B", "C"), seed=0) -> None:
    """All requests at step 0, interleaved: A sends 10x the requests of B and C."""
    rng = np.random.RandomState(seed)
    for _ in range(rounds):
        for tenant in pattern:
            add(eng, rng, tenant)


def normalized(eng) -> dict[str, float]:
    """Weighted service / weight per tenant."""
    weights = dict(eng.cfg.tenant_weights)
    return {t: s.service / weights.get(t, 1.0) for t, s in eng.stats().tenants.items()}


def run_backlogged(eng, tenants=("A", "B", "C")):
    """Step while every tenant has a waiting request; the normalized service after each step."""
    trace = []
    while all(eng.stats().tenants[t].waiting for t in tenants):
        eng.step()
        trace.append(normalized(eng))
    return trace


def max_gap(trace) -> float:
    return max(max(s.values()) - min(s.values()) for s in trace)


def test_vtc_bound_holds_at_every_step_under_fair_and_fails_under_fcfs():
    bound = SLOTS * BOUND_C  # weights 1
    fair = engine("fair", debug_checks=True)
    flood(fair, rounds=20)
    trace = run_backlogged(fair)
    assert len(trace) > 100
    assert max_gap(trace) <= bound
    fcfs = engine("fcfs")
    flood(fcfs, rounds=20)
    assert max_gap(run_backlogged(fcfs)) > 4 * bound  # the flooder takes ~10/12 of the machine


def test_weighted_shares_2_1_1_within_10_percent_and_jain_index():
    eng = engine("fair", {"A": 2})
    flood(eng, rounds=70)
    trace = run_backlogged(eng)
    assert max_gap(trace) <= SLOTS * BOUND_C  # w_min = 1
    served = {t: s.service for t, s in eng.stats().tenants.items()}
    for light in ("B", "C"):
        assert served["A"] / served[light] == pytest.approx(2.0, rel=0.10)
    x = np.array(list(trace[-1].values()))
    assert x.sum() ** 2 / (len(x) * (x**2).sum()) >= 0.99  # Jain's index of normalized service


def test_returning_tenant_gets_no_burst():
    eng = engine("fair")
    rng = np.random.RandomState(1)
    for _ in range(150):
        add(eng, rng, "A"), add(eng, rng, "B")
    for _ in range(150):
        eng.step()  # A and B build up service while C is away
    before = eng.stats().tenants
    lowest = min(before["A"].virtual_tokens, before["B"].virtual_tokens)
    for _ in range(40):
        add(eng, rng, "C")
    assert eng.stats().tenants["C"].virtual_tokens >= lowest  # lifted: no credit for idle time
    base = {t: s.service for t, s in eng.stats().tenants.items()}
    trace = run_backlogged(eng)[:60]
    gained = {t: s - base.get(t, 0.0) for t, s in trace[-1].items()}
    # From its return on, C gets about a third (all three backlogged), not the whole machine
    # until it has caught up with A and B.
    assert gained["C"] <= sum(gained.values()) / 3 + SLOTS * BOUND_C


def light_latency(policy: str) -> tuple[float, float]:
    """A floods 200 requests of mixed lengths; B and C send one request at a time. Their mean
    latency (steps from arrival to the last token) under the flood, and on an idle engine."""

    def one_at_a_time(eng, rng, flood_ids=(), sends=13):
        start, latencies, current = {}, [], {}
        step = 0
        while eng.has_unfinished_requests() or len(latencies) < 2 * sends:
            for t in ("B", "C"):
                rid = current.get(t)
                if rid is not None and eng.requests[rid].finished:
                    latencies.append(step - start.pop(rid))
                    current[t] = rid = None
                flooding = any(not eng.requests[r].finished for r in flood_ids)
                if rid is None and (flooding or (len(latencies) < 2 * sends and not flood_ids)):
                    rid = current[t] = add(eng, rng, t, 8, 16)
                    start[rid] = step
            if not eng.has_unfinished_requests():
                break
            eng.step()
            step += 1
        return latencies

    idle = one_at_a_time(engine(policy), np.random.RandomState(2))
    eng = engine(policy)
    rng = np.random.RandomState(3)
    ids = [add(eng, rng, "A", 24, 24) for _ in range(200)]
    busy = one_at_a_time(eng, np.random.RandomState(2), ids)
    for rid in ids:  # every one of the flood's requests is served, exactly
        seq = eng.requests[rid]
        assert seq.finish_reason == "length"
        want = expected_tokens(seq.prompt_ids, seq.max_tokens, 0, False, VOCAB)
        assert seq.output_ids == want
    return float(np.mean(busy)), float(np.mean(idle))


def test_light_tenants_are_not_hurt_by_a_flood_under_fair_but_are_under_fcfs():
    busy, idle = light_latency("fair")
    assert busy <= 3 * idle
    busy_fcfs, idle_fcfs = light_latency("fcfs")
    assert busy_fcfs > 10 * idle_fcfs  # waits behind A's whole backlog


def first_victim(policy: str) -> str:
    """'rich' is admitted first, then three requests of 'p'; the pool cannot hold all four."""
    eng = engine(policy, num_pages=16, max_seq_len=40, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eng.add_request([5] * 20, params, tenant="rich")
    eng.step()
    for i in range(3):
        eng.add_request([6 + i] * 20, params, tenant="p")
    eng.scheduler.ledger.charge("rich", prompt=1000)  # rich has had far more service
    while eng.has_unfinished_requests():
        before = set(eng.scheduler.running.values())
        eng.step()
        gone = [s for s in before - set(eng.scheduler.running.values()) if not s.finished]
        if gone:
            return gone[0].tenant
    raise AssertionError("no preemption happened")


def test_preemption_evicts_the_tenant_with_the_largest_counter_first():
    assert first_victim("fair") == "rich"
    assert first_victim("priority") == "p"  # the most recently admitted


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, 7])
def test_bad_tenant_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="tenant"):
        engine("fair").add_request([5, 6], tenant=bad)


def test_bad_policy_and_weights_are_refused(tmp_path):
    with pytest.raises(ValueError, match="scheduling_policy"):
        engine("lottery")
    with pytest.raises(ValueError, match=r"tenant_weights\['A'\]"):
        engine("fair", {"A": -1})
    path = tmp_path / "w.json"
    path.write_text("[1, 2]")
    from jbatch.engine.tenants import load_tenant_weights

    with pytest.raises(ValueError, match="JSON object"):
        load_tenant_weights(str(path))
    path.write_text('{"A": 2, "B": 0.5}')
    assert load_tenant_weights(str(path)) == (("A", 2.0), ("B", 0.5))


def test_tenant_label_cardinality_is_capped_top_n_plus_other():
    from jbatch.engine.tenants import TenantStats
    from serving.tenant_metrics import capped

    tenants = {f"t{i}": TenantStats(prompt_tokens=i, running=1) for i in range(50)}
    out = capped(tenants, 3)
    assert list(out) == ["t49", "t48", "t47", "other"]  # the most served keep their label
    assert out["other"].prompt_tokens == sum(range(47)) and out["other"].running == 47


def test_fair_policy_on_a_real_model_no_recompiles_and_exact_tokens(hf_checkpoint):
    """Three tenants (weights 2:1:1) on a tiny Llama under ``fair``: nothing compiles after
    warm-up, every token is HF's argmax, and each tenant is charged what it was served."""
    from jbatch import LLM
    from tests.compile_counter import count_compiles
    from tests.test_engine import assert_teacher_forced

    path, model = hf_checkpoint("llama")
    llm = LLM(
        path, max_slots=4, page_size=8, num_pages=40, max_num_batched_tokens=32,
        max_seq_len=96, block_q=16, scheduling_policy="fair", tenant_weights={"A": 2},
        debug_checks=True,
    )  # fmt: skip
    eng, rng = llm.engine, np.random.RandomState(5)
    work = {}
    with count_compiles() as compiled:
        for i in range(12):
            tenant = "ABCAAB"[i % 6]
            prompt = rng.randint(3, 300, int(rng.randint(2, 40))).tolist()
            p = SamplingParams(temperature=0.0, max_tokens=int(rng.randint(2, 12)), ignore_eos=True)
            work[eng.add_request(prompt, p, tenant=tenant)] = (tenant, prompt, p.max_tokens)
        while eng.has_unfinished_requests():
            eng.step()
    assert compiled == [], f"compiled after warm-up: {compiled}"
    tenants = eng.stats().tenants
    for t in "ABC":
        mine = [w for w in work.values() if w[0] == t]
        assert tenants[t].output_tokens == sum(m for _, _, m in mine)
        assert tenants[t].prompt_tokens <= sum(len(p) for _, p, _ in mine)  # cache hits are free
    for rid, (_, prompt, max_tokens) in work.items():
        out = eng.requests[rid].output_ids
        assert len(out) == max_tokens
        assert_teacher_forced(model, prompt, out)


def test_router_sums_tenant_figures_over_replicas():
    from jbatch.parallel.router import ReplicaRouter

    router = ReplicaRouter([engine("fair"), engine("fair")])
    rng = np.random.RandomState(6)
    ids = [add(router, rng, t) for t in "AABBC" * 2]
    while router.has_unfinished_requests():
        router.step()
    tenants = router.stats().tenants
    for t in "ABC":
        mine = [router.engines[router.replica_of(r)].requests[r] for r in ids]
        mine = [s for s in mine if s.tenant == t]
        assert tenants[t].output_tokens == sum(s.max_tokens for s in mine)
        assert tenants[t].waiting == tenants[t].running == 0
    assert {router.replica_of(r) for r in ids} == {0, 1}


def test_service_on_an_idle_engine_is_not_held_against_a_tenant():
    """X uses the engine alone (nobody else wants it), then Y floods; X's next request waits
    only for a free slot, not until Y has caught up with X's past service."""
    eng, rng = engine("fair"), np.random.RandomState(7)
    for _ in range(30):
        add(eng, rng, "X")
    while eng.has_unfinished_requests():
        eng.step()
    for _ in range(60):
        add(eng, rng, "Y")
    for _ in range(10):
        eng.step()
    seq = eng.requests[add(eng, rng, "X")]
    while seq.first_scheduled_step is None:
        eng.step()
    assert seq.first_scheduled_step - seq.waiting_since <= 2 * MAX_OUT  # one slot's turnover
