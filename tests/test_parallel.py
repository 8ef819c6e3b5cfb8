"""Tensor and data parallelism on simulated CPU devices.

The multi-device runs happen in subprocesses (``tests/parallel_worker.py``) started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``: the flag must be set before JAX starts,
and this pytest process has one device. All subprocesses start together (module fixture) and run
concurrently; the tests assert on their JSON. XLA's backend optimisation level is lowered in the
workers to halve compile time — every config in a worker is compiled the same way, so outputs
are compared like with like.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from jbatch import EngineConfig, LLMEngine, SamplingParams
from jbatch.engine.mock_core import MockCore, expected_tokens
from jbatch.models.config import ModelConfig
from jbatch.parallel import ReplicaRouter, kv_replication, make_mesh, sharded_model_config
from jbatch.tiny_model import write_random_llama
from tests.parallel_worker import WORKLOAD

ROOT = Path(__file__).resolve().parents[1]
FULL = "1x1,2x1,4x1,8x1,4x2"  # tp x dp
# llama (2 KV heads: split at tp=2, replicated at 4 and 8) runs the full matrix; qwen2 (4 KV heads:
# split at 2, replicated at 8) and mistral (8 KV heads: always split) the tp values that differ
# for them — dp is model-agnostic (replicas + router), and CPU time in CI is short.
# mistral (head dim 16) also runs the Pallas kernel (interpret mode) per shard under shard_map.
# qwen3_moe (mixture of experts, tests/test_moe.py): experts split inside, at tp=2; gemma2 (soft
# caps, sandwich norms) and phi3 (fused qkv/gate_up split as the shards are read) at tp=2.
# llama also runs blocks of 4 decode steps (decode_steps) on a tp=2 mesh.
MATRIX = {
    "llama_tp": FULL + ",2x1:::4",
    "qwen2_tp": "1x1,2x1,8x1",
    "mistral_tp": "1x1,2x1,8x1,4x1:pallas_interpret",
    "qwen3_moe": "1x1,2x1",
    "gemma2_tp": "1x1,2x1",
    "phi3_tp": "1x1,2x1",
}
TIMEOUT = 900


def _spawn(args: list[str], devices: int) -> subprocess.Popen:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    )
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "tests.parallel_worker", *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=TIMEOUT)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(hf_checkpoint, tmp_path_factory):
    """Start every worker at once; collect their results."""
    ckpts = {name: str(hf_checkpoint(name)[0]) for name in MATRIX}
    big = write_random_llama(
        tmp_path_factory.mktemp("big"), vocab_size=8192, hidden_size=512,
        intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=2, tokenizer=False,
    )  # fmt: skip
    port = _free_port()
    procs = {f"matrix/{n}": _spawn(["matrix", ckpts[n], c], 8) for n, c in MATRIX.items()}
    procs |= {
        f"multihost/{i}": _spawn(["multihost", ckpts["llama_tp"], str(port), str(i), "2"], 2)
        for i in range(2)
    }
    procs["rss"] = _spawn(["load_rss", str(big), "8"], 8)
    store = tmp_path_factory.mktemp("executables")
    procs["stored"] = _spawn(["stored", ckpts["llama_tp"], str(store)], 2)
    try:
        return {key: _result(p) for key, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("variant", list(MATRIX))
def test_greedy_outputs_identical_on_every_mesh(runs, variant):
    results = runs[f"matrix/{variant}"]
    one_device = results["tp1_dp1"]["outputs"]
    assert sorted(one_device) == [f"q{i}" for i in range(len(WORKLOAD))]
    for i, (_, max_tokens, _) in enumerate(WORKLOAD):
        assert len(one_device[f"q{i}"]) == max_tokens
    assert len({tuple(v) for v in one_device.values()}) == len(WORKLOAD)  # not degenerate
    for config, r in results.items():
        assert r["outputs"] == one_device, f"{variant} {config} differs from one device"
        assert r["compiles_after_warmup"] == [], f"{variant} {config} recompiled"
    for config, r in results.items():  # the tiny pool forced swaps through the sharded pool
        if "steps" in config.split("_")[-1]:  # blocks of decode steps (a roomy pool instead)
            assert r["dispatches"] < r["steps"], (config, r["dispatches"], r["steps"])
        else:
            assert r["swap_outs"] > 0 or "dp2" in config


@pytest.mark.parametrize("mesh", ["tp2_dp1", "tp1_dp2"])
def test_sharded_engines_load_their_step_programs_from_the_store(runs, mesh):
    """tp = 2, and dp = 2 (two replicas of one config on different devices: each must get its
    own programs): the second build loads every step program the first stored, placed on the
    same devices, and serves the same tokens as one device."""
    first, second = runs["stored"][mesh]
    for built, again in zip(first["programs"], second["programs"]):  # per replica
        n = built["compiled"]
        assert n > 0 and built == {"loaded": 0, "compiled": n, "stored": n}
        assert again == {"loaded": n, "compiled": 0, "stored": 0}
    assert second["outputs"] == first["outputs"] == runs["matrix/llama_tp"]["tp1_dp1"]["outputs"]
    assert second["compiles_after_warmup"] == [] == first["compiles_after_warmup"]


# layer param -> axis split over tp (None: replicated), the sharding rules in words
EXPECTED_AXES = {
    "wq": 2, "wk": 2, "wv": 2, "bq": 1, "bk": 1, "bv": 1, "wo": 1,
    "w_gate": 2, "w_up": 2, "w_down": 1, "attn_norm": None, "mlp_norm": None,
    "q_norm": None, "k_norm": None,
    "router": None, "expert_gate": 3, "expert_up": 3, "expert_down": 2,  # [L, N, E|F, F|E]
}  # fmt: skip


@pytest.mark.parametrize("variant", list(MATRIX))
def test_param_and_kv_pool_shardings(runs, variant, hf_checkpoint):
    model_cfg = ModelConfig.from_file(Path(hf_checkpoint(variant)[0]) / "config.json")
    for config, r in runs[f"matrix/{variant}"].items():
        tp = int(config[2 : config.index("_")])
        kvh = model_cfg.num_kv_heads * max(1, tp // model_cfg.num_kv_heads)  # replicated heads
        devices = set()
        for rep in r["replicas"]:
            assert rep["num_kv_heads"] == kvh
            for name, d in rep["params"].items():
                key = name.split("/")[-1]
                axis = 0 if key in ("embed", "lm_head") else EXPECTED_AXES.get(key)
                spec = [None] * len(d["shape"])
                shard = list(d["shape"])
                if axis is not None:
                    spec[axis], shard[axis] = "tp", shard[axis] // tp
                padded = d["spec"] + [None] * (len(spec) - len(d["spec"]))  # P() pads with None
                assert padded == spec, f"{variant} {config} {name}: spec {d['spec']}"
                assert d["shard_shapes"] == [shard], f"{variant} {config} {name}"
                assert len(d["devices"]) == tp
            if "bk" in rep["params"]:  # qwen2: K/V biases follow their replicated heads
                assert rep["params"]["layers/bk"]["shape"][1] == kvh * model_cfg.head_dim
            for pool in rep["kv"]:  # [pages, page_size, kv_heads, head_dim], split on heads
                assert pool["spec"] == [None, None, "tp", None]
                p, s, h, d = pool["shape"]
                assert h == kvh and d == model_cfg.head_dim
                assert pool["shard_shapes"] == [[p, s, kvh // tp, d]]
                assert len(pool["devices"]) == tp
            slots = rep["slot_arrays"]  # page tables: replicated
            assert slots["spec"] == [] and slots["shard_shapes"] == [slots["shape"]]
            assert not devices & set(rep["kv"][0]["devices"]), "replicas share devices"
            devices |= set(rep["kv"][0]["devices"])


def test_attention_runs_per_shard(runs):
    """The compiled tp=4 decode step communicates only where Megatron-style TP must: one
    all-reduce after each row-parallel matmul (wo, w_down: 2 per layer), one for the
    vocab-split embedding lookup, one all-gather of the [slots, vocab] logits. Attention and the
    KV pool never leave their shard; no weight is gathered."""
    found = runs["matrix/llama_tp"]["tp4_dp1"]["collectives"]
    layers = 2
    assert found == {
        "all-reduce <- dot_general": 2 * layers,
        "all-reduce <- gather": 1,
        "all-gather <- sharding_constraint": 1,
    }


def test_moe_experts_all_reduce_once_per_layer(runs):
    """qwen3_moe at tp=2 (3 layers: 2 routed, 1 dense): one all-reduce after each ``wo`` (3) and
    the dense ``w_down`` (1), one ``psum`` per routed layer (2), none inside the experts' loop."""
    found = runs["matrix/qwen3_moe"]["tp2_dp1"]["collectives"]
    assert found == {
        "all-reduce <- dot_general": 4,
        "all-reduce <- psum": 2,
        "all-reduce <- gather": 1,
        "all-gather <- sharding_constraint": 1,
    }


def test_data_parallel_router_balances(runs):
    r = runs["matrix/llama_tp"]["tp4_dp2"]
    assert len(r["replicas"]) == 2 and r["routed"] == [3, 3]


def test_multihost_two_processes(runs):
    """2 processes x 2 CPU devices, jax.distributed + gloo, one tp=4 mesh across both."""
    one_device = runs["matrix/llama_tp"]["tp1_dp1"]["outputs"]
    for i in range(2):
        r = runs[f"multihost/{i}"]
        assert (r["process_index"], r["process_count"], r["tp"]) == (i, 2, 4)
        assert r["local_devices"] == 2 and len(r["kv"]["devices"]) == 4
        assert r["kv"]["shard_shapes"] == [[12, 4, 1, 8]]  # 2 KV heads replicated to 4
        assert r["outputs"] == one_device
        assert r["swap_outs"] > 0


def test_sharded_load_peak_host_memory(runs):
    """Loading straight into shards peaks at about the params' own size (on CPU the devices'
    memory is host memory too): no whole-param copy on the host or on one device. (Loading whole
    params and then sharding them peaks at about twice that: see docs/scaling.md.)"""
    r = runs["rss"]
    grew, params = r["rss_peak"] - r["rss_before"], r["params_bytes"]
    print(f"sharded load: peak RSS +{grew / 2**20:.0f} MiB for {params / 2**20:.0f} MiB of params")
    assert r["wq_shard_shapes"] == [[4, 512, 64]]
    assert grew < 1.25 * params + 24 * 2**20


# ---- in this process (one device) ----------------------------------------------------------------


def _cfg(h: int, kvh: int) -> ModelConfig:
    return ModelConfig("llama", 64, 32, 64, 1, h, kvh, 8)


def test_kv_head_replication_rules():
    assert kv_replication(_cfg(8, 8), 4) == 1  # split: 2 KV heads per shard
    assert kv_replication(_cfg(8, 2), 8) == 4  # each KV head on 4 shards
    assert sharded_model_config(_cfg(8, 2), 8).num_kv_heads == 8
    assert sharded_model_config(_cfg(8, 4), 2) == _cfg(8, 4)
    with pytest.raises(ValueError, match="must divide the model's num_attention_heads=8"):
        kv_replication(_cfg(8, 2), 3)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        kv_replication(_cfg(12, 3), 2)


def test_mesh_larger_than_the_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"dp=2 x tp=4 needs 8 devices but only 1"):
        make_mesh(4, 2)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        make_mesh(0, 1)
    with pytest.raises(ValueError, match="dp must be a positive int"):
        EngineConfig(dp=0)


def test_cli_has_parallel_flags():
    from jbatch.cli import _build_parser

    args = _build_parser().parse_args(["generate", "x", "--tp", "4", "--dp", "2"])
    assert (args.tp, args.dp) == (4, 2)
    args = _build_parser().parse_args(
        ["serve", "--coordinator-address", "10.0.0.1:1234", "--num-processes", "2",
         "--process-id", "1"]
    )  # fmt: skip
    assert (args.coordinator_address, args.num_processes, args.process_id) == (
        "10.0.0.1:1234", 2, 1
    )  # fmt: skip


def _mock_engine(cfg: EngineConfig) -> LLMEngine:
    return LLMEngine(
        types.SimpleNamespace(vocab_size=97, max_position_embeddings=1 << 20),
        None,
        cfg,
        core=MockCore(cfg, 97),
    )


def test_router_least_loaded_and_exact_outputs():
    cfg = EngineConfig(max_slots=2, page_size=4, num_pages=32, max_seq_len=64, block_q=4)
    router = ReplicaRouter([_mock_engine(cfg) for _ in range(3)])
    sp = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    prompts = {router.add_request([i + 3, i + 4], sp(4 + i % 3)): i for i in range(5)}
    assert router.routed == [2, 2, 1]  # round-robin while equally loaded
    # Replica 2 has the smallest backlog: the next request goes there.
    rid = router.add_request([9, 9, 9], sp(30))
    assert router.replica_of(rid) == 2
    with pytest.raises(ValueError, match="already in use"):
        router.add_request([1], sp(1), request_id=rid)
    tokens: dict[str, list[int]] = {}
    finished = set()
    while router.has_unfinished_requests():
        for out in router.step():  # deltas
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished.add(out.request_id)
    for r, i in prompts.items():
        assert tokens[r] == expected_tokens([i + 3, i + 4], 4 + i % 3, 0, False, 97)
    stats = router.stats()
    assert stats.running == stats.waiting == stats.pages_used == 0 and stats.steps > 0
    assert stats.total_slots == sum(e.cfg.max_slots for e in router.engines)
    # Forgetting a finished request drops it from its replica and from the routing table.
    assert finished == set(tokens)
    for r in finished:
        router.forget(r)
        assert router.replica_of(r) is None
    assert not any(e.requests for e in router.engines)


def test_engine_thread_serves_a_router():
    """The server's engine thread drives a ReplicaRouter exactly like one engine."""
    import asyncio

    from serving.engine_thread import EngineThread

    cfg = EngineConfig(max_slots=2, page_size=4, num_pages=32, max_seq_len=64, block_q=4)
    router = ReplicaRouter([_mock_engine(cfg) for _ in range(2)])
    thread = EngineThread(router, max_queue=64)
    thread.start()
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    async def run() -> dict[int, list[int]]:
        streams = [(i, thread.submit([i + 3, i + 4], sp)) for i in range(6)]
        got = {}
        for i, stream in streams:
            got[i] = [t async for delta in stream for t in delta.token_ids]
        return got

    try:
        got = asyncio.run(run())
    finally:
        thread.shutdown(timeout=5)
    for i, tokens in got.items():
        assert tokens == expected_tokens([i + 3, i + 4], 5, 0, False, 97)
    assert sum(router.routed) == 6 and min(router.routed) >= 1
    assert router.stats().total_slots == 4 and thread.metrics.utilization._value.get() <= 1.0
    assert not any(e.requests for e in router.engines)  # finished requests were forgotten
