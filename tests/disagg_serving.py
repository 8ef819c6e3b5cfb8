"""Helpers of the two-process disaggregation tests (``tests/test_disaggregation.py``): start
``jbatch serve``, wait for health, read a metric, a fake decode peer that refuses handovers."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import threading
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.proto.jbatch.v1 import disaggregation_pb2 as disagg_pb
from serving.proto.jbatch.v1 import disaggregation_pb2_grpc as disagg_grpc

SERVE_FLAGS = [
    "--max-slots", "4", "--page-size", "4", "--max-num-batched-tokens", "32", "--block-q", "8",
    "--max-seq-len", "96", "--grpc-port", "0", "--http-port", "0", "--shutdown-timeout", "2",
]  # fmt: skip
PORT_LINE = re.compile(r"gRPC on [\d.]+:(\d+), HTTP on [\d.]+:(\d+)")


def start(ckpt, *flags) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "jbatch.cli", "serve", "--model", str(ckpt), *SERVE_FLAGS]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    proc = subprocess.Popen([*cmd, *flags], stderr=subprocess.PIPE, text=True, env=env)
    for _ in range(200):  # the port line comes before the model loads
        if m := PORT_LINE.search(proc.stderr.readline()):
            drain = lambda: collections.deque(proc.stderr, maxlen=200)  # never fill the pipe
            threading.Thread(target=drain, daemon=True).start()
            return proc, f"127.0.0.1:{m.group(1)}", f"http://127.0.0.1:{m.group(2)}"
    proc.kill()
    raise AssertionError("no port line from jbatch serve")


def wait_serving(target: str, timeout: float = 240.0) -> None:
    req = health_pb2.HealthCheckRequest(service="jbatch.v1.Generation")
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                if stub.Check(req, timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise AssertionError(f"{target} did not become SERVING")


class RefusingPeer(disagg_grpc.DisaggregationServicer):
    """A decode peer that reports the most free pages and refuses every handover: each request
    is offered here first, then handed over to the real decode server (the retry path)."""

    def __init__(self):
        self.refused = 0

    def PoolStatus(self, request, context):
        return disagg_pb.PoolStatusResponse(free_pages=1 << 30, total_pages=1 << 30)

    def Handover(self, request, context):
        self.refused += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "a refusing peer (test)")
        yield  # a server-streaming handler


def metric(http: str, name: str) -> float:
    text = httpx.get(http + "/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def eventually(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
