"""``jbatch serve`` as a real process: health NOT_SERVING while loading then SERVING,
``jbatch client`` streams, SIGTERM drains in-flight requests, refuses new ones, exits 0."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jbatch import SamplingParams
from serving.client import GenerationClient, finish_reason_name
from tests.hf_models import make_checkpoint

ENGINE_FLAGS = [
    "--max-slots",
    "2",
    "--page-size",
    "8",
    "--num-pages",
    "80",
    "--max-num-batched-tokens",
    "16",
    "--max-seq-len",
    "512",
    "--block-q",
    "16",
]


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        req = health_pb2.HealthCheckRequest(service="jbatch.v1.Generation")
        return health_pb2_grpc.HealthStub(channel).Check(req, timeout=5).status


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_llama")
    make_checkpoint("llama", path)
    cmd = [sys.executable, "-m", "jbatch.cli", "serve", "--model", str(path)]
    cmd += ["--grpc-port", "0", "--http-port", "0", "--metrics-port", "0"]
    cmd += ["--shutdown-timeout", "20", *ENGINE_FLAGS]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ports = None
        for _ in range(200):  # the first line comes before the model loads
            line = proc.stderr.readline()
            pattern = r"gRPC on [\d.]+:(\d+), HTTP on [\d.]+:(\d+), metrics on [\d.]+:(\d+)"
            if m := re.search(pattern, line):
                ports = [int(g) for g in m.groups()]
                break
        assert ports, "no port line from jbatch serve"
        yield proc, f"127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}", ports[2]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_serve_client_and_graceful_sigterm(server_process):
    proc, target, http, metrics_port = server_process
    # Loading: not serving yet, generation refused.
    assert _health(target) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert httpx.get(http + "/health").status_code == 503

    async def refused():
        async with GenerationClient(target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete("hi", SamplingParams(max_tokens=2), timeout=10)
        return info.value.code()

    assert asyncio.run(refused()) == grpc.StatusCode.UNAVAILABLE
    for _ in range(600):  # bounded: warm-up takes seconds
        if _health(target) == health_pb2.HealthCheckResponse.SERVING:
            break
        time.sleep(0.1)
    assert _health(target) == health_pb2.HealthCheckResponse.SERVING

    out = subprocess.run(
        [sys.executable, "-m", "jbatch.cli", "client", "--target", target, "--max-tokens", "6"]
        + ["--ignore-eos", "The quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The quick") and "length: " in out.stderr
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    assert 'jbatch_requests_total{finish_reason="length",status="ok"} 1.0' in metrics

    # Long enough that the drain is still under way while the refusals are checked: once the
    # in-flight request finishes, the server exits and a new connection is simply refused.
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def drain_while_streaming():
        async with GenerationClient(target) as client:
            stream = client.generate([5, 6, 7], long, timeout=60)
            first = await anext(stream)
            proc.send_signal(signal.SIGTERM)
            for _ in range(500):  # bounded: wait until the server stops admitting
                if httpx.get(http + "/health").status_code == 503:
                    break
                await asyncio.sleep(0.01)
            r = httpx.post(http + "/v1/completions", json={"prompt": "hi"}, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete([5, 6, 7], long, timeout=10)
            rest = [resp async for resp in stream]
            return first, rest, info.value.code(), r.status_code

    first, rest, code, status = asyncio.run(drain_while_streaming())
    assert code == grpc.StatusCode.UNAVAILABLE and status == 503
    assert sum(len(r.token_ids) for r in [first, *rest]) == 500, "in-flight request must finish"
    assert finish_reason_name(rest[-1]) == "length"
    assert proc.wait(60) == 0
