"""Disaggregated prefill and decode (``jbatch/engine/handover.py``,
``jbatch/parallel/disaggregated.py``).

Fast checks run on the MockCore in this process; the real-model check (tp=4 prefill on
devices 0-3, tp=4 decode on 4-7, against a mixed tp=4 engine) runs in a subprocess that sees 8
simulated CPU devices (``tests/disagg_worker.py``), started once for the module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import grpc
import httpx
import pytest

from jbatch import EngineConfig, LLMEngine, SamplingParams
from jbatch.engine import buckets
from jbatch.engine.interface import EngineClient
from jbatch.engine.mock_core import MockCore
from jbatch.outputs import OutputKind
from jbatch.parallel.disaggregated import DisaggregatedEngine
from serving.client import GenerationClient
from serving.proto.jbatch.v1 import disaggregation_pb2_grpc as disagg_grpc
from tests.disagg_serving import RefusingPeer, eventually, metric, start, wait_serving
from tests.disagg_worker import NUM_REQUESTS
from tests.hf_models import make_checkpoint

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
    assert prefill == {(8, 0), (16, 0), (24, 0), (32, 0)}  # prompt rows only, no decode row
    assert decode == {(0, 1), (0, 2), (0, 4), (0, 8)}  # decode-only programs
    assert decode < mixed and not prefill & mixed
    assert EngineConfig(**cfg, role="prefill").swaps and not EngineConfig(**cfg).swaps
    # A handover copies its pages padded to a power of two, not to max_pages_per_seq (16).
    assert buckets.handover_page_buckets(EngineConfig(**cfg)) == (1, 2, 4, 8, 16)
    assert buckets.pick_handover_bucket(EngineConfig(**cfg), 5) == 8


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
    # The decode side reuses its own prefix cache: the shared prompt pages it already holds
    # are not written again (swap-ins share them).
    assert sum(d.stats().prefix_cache_hits for d in decodes) > 0
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


# ---- the transfer server (one process, one device) ------------------------------------------
def test_kv_transfer_pulls_checks_specs_and_withdraws():
    import jax
    import jax.numpy as jnp

    from serving.kv_transfer import KvTransfer

    sender, receiver = KvTransfer(), KvTransfer()
    tree = {"k": jnp.arange(24.0).reshape(2, 3, 4), "rows": jnp.array([5, 6], jnp.int32)}
    template = jax.eval_shape(lambda t: t, tree)
    uuid, specs = sender.offer(tree)
    assert specs == [((2, 3, 4), "float32"), ((2,), "int32")]
    pulled = receiver.pull(sender.address, uuid, specs, template, jax.devices()[0])
    same = jax.tree.map(lambda a, b: bool((a == b).all()), pulled, tree)
    assert same == {"k": True, "rows": True}
    with pytest.raises(ValueError, match="do not match"):
        receiver.pull(sender.address, uuid, [((2, 3, 5), "float32"), ((2,), "int32")], template,
                      jax.devices()[0])  # fmt: skip
    uuid, _ = sender.offer(tree)
    done = threading.Thread(target=sender.withdraw, args=(uuid, tree), daemon=True)
    done.start()
    done.join(20)
    assert not done.is_alive()  # the offer was taken back (a self-pull)


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
    assert inprocess["prefix_hits"]["decode"] > 0  # handed-over prompts share cached pages
    assert inprocess["swap_outs"]["decode"] > 0  # the small decode pool preempted by swapping
    assert inprocess["programs"] == {
        "prefill": [[8, 0], [16, 0], [24, 0], [32, 0]],
        "decode": [[0, 1], [0, 2], [0, 4], [0, 8]],
    }
    for key in ("pages_used", "requests_left"):
        assert inprocess[key] == {"prefill": 0, "decode": 0}, key
    assert inprocess["slots_free"] == {"prefill": 8, "decode": 8}


# ---- two `jbatch serve` processes on loopback: KV through JAX's transfer server ---------------
@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("disagg_llama")
    make_checkpoint("llama", ckpt)
    refusing = RefusingPeer()
    fake = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    disagg_grpc.add_DisaggregationServicer_to_server(refusing, fake)
    fake_peer = f"127.0.0.1:{fake.add_insecure_port('127.0.0.1:0')}"
    fake.start()
    procs = []
    try:
        decode = start(ckpt, "--role", "decode", "--num-pages", "40")
        procs.append(decode[0])
        peers = f"{decode[1]},{fake_peer}"
        prefill = start(ckpt, "--role", "prefill", "--num-pages", "64", "--decode-peers", peers)
        procs.append(prefill[0])
        wait_serving(decode[1])
        wait_serving(prefill[1])
        yield ckpt, decode, prefill, refusing
    finally:
        fake.stop(0)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def _mixed_tokens(ckpt, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from jbatch import LLM

    llm = LLM(str(ckpt), max_slots=4, page_size=4, max_num_batched_tokens=32, block_q=8,
              max_seq_len=96, num_pages=64)  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


async def _complete_all(target, prompts, max_tokens):
    async with GenerationClient(target) as client:
        calls = [
            client.complete(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, max_tokens)
        ]
        return await asyncio.gather(*calls)


@pytest.mark.slow
def test_two_processes_match_a_mixed_engine(two_servers):
    ckpt, _, prefill, refusing = two_servers
    rng = random.Random(3)
    shared = [rng.randrange(3, 384) for _ in range(12)]
    prompts = [
        shared * (i % 2) + [rng.randrange(3, 384) for _ in range(3 + 2 * i)] for i in range(8)
    ]
    max_tokens = [1, 5, 12, 20, 7, 30, 3, 16]
    got = asyncio.run(_complete_all(prefill[1], prompts, max_tokens))
    assert [c.token_ids for c in got] == _mixed_tokens(ckpt, prompts, max_tokens)
    assert [c.completion_tokens for c in got] == max_tokens
    assert all(c.finish_reason == "length" for c in got)
    assert refusing.refused >= 7  # each handover was refused there first, then went elsewhere
    # The HTTP API of the prefill server streams from the decode server the same way.
    body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(prefill[2] + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 6


@pytest.mark.slow
def test_logprobs_and_structured_output_cross_the_handover(two_servers):
    from jbatch.structured_output import StructuredOutput

    _, _, prefill, _ = two_servers

    async def run():
        async with GenerationClient(prefill[1]) as client:
            sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
            with_logprobs = [r async for r in client.generate([7, 8, 9, 10], sp, timeout=60)]
            choices = ["alpha beta gamma delta", "epsilon zeta eta theta"]  # several tokens each
            choice = StructuredOutput(choice=choices)
            sp = SamplingParams(temperature=0.0, max_tokens=20, structured=choice)
            text = (await client.complete("Pick one:", sp, timeout=60)).text
        return with_logprobs, text, choices

    responses, text, choices = asyncio.run(run())
    assert sum(len(r.token_ids) for r in responses) == 6
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    assert all(len(p.top) == 2 for r in responses for p in r.logprobs)
    assert text in choices  # the grammar was rebuilt on the decode server


@pytest.mark.slow
def test_a_decode_server_refuses_plain_requests(two_servers):
    _, decode, _, _ = two_servers
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_complete_all(decode[1], [[3, 4, 5]], [4]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.slow
def test_a_cancelled_stream_frees_the_decode_pages(two_servers):
    _, decode, prefill, _ = two_servers

    async def cancel_after_two_tokens() -> int:
        received = 0
        async with GenerationClient(prefill[1]) as client:
            sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
            async for resp in client.generate(list(range(10, 30)), sp, timeout=60):
                received += len(resp.token_ids)
                if received >= 2:
                    break  # leaving the loop cancels the call
        return received

    assert asyncio.run(cancel_after_two_tokens()) >= 2
    assert eventually(lambda: metric(decode[2], "jbatch_kv_pages_used") == 0)
    assert metric(prefill[2], "jbatch_kv_pages_used") == 0


@pytest.mark.slow
def test_a_killed_decode_server_fails_requests_unavailable(two_servers):
    _, decode, prefill, _ = two_servers

    async def killed_mid_stream():
        async with GenerationClient(prefill[1]) as client:
            sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
            received = 0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for resp in client.generate([5, 6, 7, 8, 9], sp, timeout=60):
                    received += len(resp.token_ids)
                    if received >= 3 and decode[0].poll() is None:
                        decode[0].kill()  # mid-stream: the request is on the decode server
            return info.value.code(), received

    code, received = asyncio.run(killed_mid_stream())
    assert code == grpc.StatusCode.UNAVAILABLE and 3 <= received < 80
    decode[0].wait(30)
    # No decode peer left: UNAVAILABLE after the prefill, not a hang.
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_complete_all(prefill[1], [[3, 4, 5, 6]], [8]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 20
    assert metric(prefill[2], "jbatch_kv_pages_used") == 0  # nothing leaked on the prefill side
