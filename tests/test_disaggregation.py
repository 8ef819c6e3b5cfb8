"""Disaggregated prefill and decode (``jbatch/engine/handover.py``,
``jbatch/parallel/disaggregated.py``).

Fast checks run on the MockCore in this process; the real-model check (tp=4 prefill on
devices 0-3, tp=4 decode on 4-7, against a mixed tp=4 engine) runs in a subprocess that sees 8
simulated CPU devices (``tests/disagg_worker.py``), started once for the module.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

from jbatch import EngineConfig, LLMEngine, SamplingParams
from jbatch.engine import buckets
from jbatch.engine.interface import EngineClient
from jbatch.engine.mock_core import MockCore
from jbatch.outputs import OutputKind
from jbatch.parallel.disaggregated import DisaggregatedEngine
from tests.disagg_worker import NUM_REQUESTS

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 97


def mock_engine(role="mixed", **kw) -> LLMEngine:
    cfg = EngineConfig(**{"block_q": 4, "page_size": 4, "num_pages": 64, "max_seq_len": 64,
                          "max_slots": 4, "debug_checks": True, "role": role, **kw})  # fmt: skip
    model_cfg = types.SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20)
    return LLMEngine(model_cfg, None, cfg, core=MockCore(cfg, VOCAB))


def mock_disaggregated(decode_pages=(64,), **kw) -> DisaggregatedEngine:
    decodes = [mock_engine("decode", num_pages=n, **kw) for n in decode_pages]
    return DisaggregatedEngine(mock_engine("prefill", **kw), decodes)


def run_all(engine, requests) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for i, (prompt, n, kind) in enumerate(requests):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(prompt, sp, request_id=f"q{i}", output_kind=kind)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens


def random_requests(seed: int, n: int = 40):
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]
    tail = lambda: [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))]
    return [
        (
            (shared if i % 2 else []) + tail(),
            rng.choice([1, 2, 5, 12, 30]),
            rng.choice([OutputKind.DELTA, OutputKind.FINAL]),
        )
        for i in range(n)
    ]


# ---- roles ---------------------------------------------------------------------------------------
def test_role_is_validated():
    with pytest.raises(ValueError, match="role must be one of"):
        EngineConfig(role="both")


def test_each_role_compiles_its_own_programs():
    cfg = dict(max_slots=8, page_size=4, num_pages=64, max_seq_len=64, block_q=8,
               max_num_batched_tokens=32)  # fmt: skip
    mixed = set(buckets.bucket_pairs(EngineConfig(**cfg)))
    prefill = set(buckets.bucket_pairs(EngineConfig(**cfg, role="prefill")))
    decode = set(buckets.bucket_pairs(EngineConfig(**cfg, role="decode")))
    assert prefill == {(8, 0), (32, 0)}  # prompt rows only, no decode row
    assert decode == {(0, 1), (0, 2), (0, 4), (0, 8)}  # decode-only programs
    assert decode < mixed and not prefill & mixed
    assert EngineConfig(**cfg, role="prefill").swaps and not EngineConfig(**cfg).swaps


def test_a_decode_engine_takes_no_new_requests():
    with pytest.raises(ValueError, match="handed-over requests only"):
        mock_engine("decode").add_request([3, 4], SamplingParams(max_tokens=2))


def test_mismatched_engines_are_rejected():
    with pytest.raises(ValueError, match="not 'prefill'"):
        DisaggregatedEngine(mock_engine(), [mock_engine("decode")])
    with pytest.raises(ValueError, match="page_size"):
        DisaggregatedEngine(mock_engine("prefill"), [mock_engine("decode", page_size=8)])
    engine = mock_disaggregated()
    assert isinstance(engine, EngineClient)
    with pytest.raises(ValueError, match="n=2"):
        engine.add_request([3, 4], SamplingParams(n=2, max_tokens=2))


# ---- the handover on the MockCore ----------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_same_tokens_as_a_mixed_engine(seed):
    requests = random_requests(seed)
    expected = run_all(mock_engine(), requests)
    engine = mock_disaggregated(decode_pages=(20, 20))  # small pools: decode-side preemption
    assert run_all(engine, requests) == expected
    prefill, decodes = engine.prefill, engine.decodes
    assert engine.handovers == sum(n > 1 for _, n, _ in requests)
    assert all(engine.handed_to) and sum(d.stats().swap_outs for d in decodes) > 0
    assert prefill.stats().prefix_cache_hits > 0
    for side in (prefill, *decodes):
        side.scheduler.check_invariants()
        assert side.scheduler.allocator.num_used == 0 and not side.scheduler.running


def test_abort_during_and_after_the_handover_leaks_nothing():
    engine = mock_disaggregated()
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        engine.add_request([3 + i] * 9, sp, request_id=f"a{i}")
    engine.step()  # every prompt in one step
    engine.prefill.step()  # swapped out, first tokens read: handed over, not yet taken
    assert [s.request_id for s in engine.prefill.handed_over] == ["a0", "a1", "a2", "a3"]
    engine.abort_request("a0")
    while engine.handovers < 3:
        engine.step()
    engine.abort_request("a1")  # now on the decode side
    while engine.has_unfinished_requests():
        engine.step()
    for side in (engine.prefill, *engine.decodes):
        side.scheduler.check_invariants()
        assert side.scheduler.allocator.num_used == 0
    assert engine.handovers == 3 and not engine.prefill.handed_over


# ---- real model, 4 + 4 simulated devices, tp=4 on each side --------------------------------------
@pytest.fixture(scope="module")
def inprocess(hf_checkpoint):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    ckpt = str(hf_checkpoint("llama_tp")[0])
    cmd = [sys.executable, "-m", "tests.disagg_worker", "inprocess", ckpt]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_tp_disaggregation_matches_a_mixed_engine(inprocess):
    expected = inprocess["expected"]
    assert len(expected) == NUM_REQUESTS and len({tuple(v) for v in expected.values()}) > 60
    assert inprocess["outputs"] == expected
    assert inprocess["compiles_after_warmup"] == []
    assert inprocess["handovers"] == NUM_REQUESTS - 4  # four end with their first token
    assert inprocess["kv_devices"] == {"prefill": [0, 1, 2, 3], "decode": [4, 5, 6, 7]}


def test_tp_disaggregation_exercises_cache_and_preemption(inprocess):
    assert inprocess["prefix_hits"]["prefill"] > 0
    assert inprocess["swap_outs"]["decode"] > 0  # the small decode pool preempted by swapping
    assert inprocess["programs"] == {
        "prefill": [[8, 0], [32, 0]],
        "decode": [[0, 1], [0, 2], [0, 4], [0, 8]],
    }
    for key in ("pages_used", "requests_left"):
        assert inprocess[key] == {"prefill": 0, "decode": 0}, key
    assert inprocess["slots_free"] == {"prefill": 8, "decode": 8}
