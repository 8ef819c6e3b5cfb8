"""Request limits with clear errors on both front ends: prompt tokens, max_tokens, stop
strings (count, length), stop token ids, n, body bytes (413 / RESOURCE_EXHAUSTED), and the
HTTP/2 limit on concurrent streams per gRPC connection; all shown in GetModelInfo and
/v1/models."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import httpx
import pytest

from jbatch import SamplingParams
from serving.client import GenerationClient, build_request
from serving.limits import RequestLimits
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from tests.serving_harness import (  # noqa: F401
    ENGINE,
    assert_drained,
    hardened_llm,
    running_server,
    slow_steps,
)

LIMITS = RequestLimits(
    max_body_bytes=4096,
    max_prompt_tokens=24,
    max_tokens=16,
    max_stop_strings=2,
    max_stop_string_chars=6,
    max_stop_token_ids=2,
    max_n=3,
    max_concurrent_streams=2,
)


@pytest.fixture(scope="module")
def limited(hardened_llm):  # noqa: F811
    with running_server(hardened_llm, limits=LIMITS) as s:
        s.h = hardened_llm
        yield s


def test_limits_are_in_model_info_and_models(limited):
    expected = {
        "max_body_bytes": 4096, "max_prompt_tokens": 24, "max_tokens": 16, "max_n": 3,
        "max_stop_strings": 2, "max_stop_string_chars": 6, "max_stop_token_ids": 2,
        "max_top_logprobs": 20, "max_concurrent_streams": 2,
    }  # fmt: skip
    with grpc.insecure_channel(limited.grpc_target) as channel:
        info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert dict(info.limits) == expected
    card = httpx.get(limited.http + "/v1/models").json()["data"][0]
    assert card["limits"] == expected
    defaults = RequestLimits().resolved(max_seq_len=ENGINE["max_seq_len"])
    assert defaults["max_body_bytes"] == 4 << 20 and defaults["max_prompt_tokens"] == 256


OVER = [  # (HTTP body fields, gRPC request fields, the limit named, the value named)
    ({"prompt": list(range(3, 33))}, dict(token_ids=pb.TokenIds(ids=range(3, 33))),
     "max_prompt_tokens=24", "30"),
    ({"prompt": "fox " * 40}, dict(text="fox " * 40), "max_prompt_tokens=24", "prompt tokens"),
    ({"prompt": [5], "max_tokens": 17},
     dict(token_ids=pb.TokenIds(ids=[5]), sampling_params=pb.SamplingParams(max_tokens=17)),
     "max_tokens=16", "17"),
    ({"prompt": [5], "stop": ["a", "b", "c"]},
     dict(token_ids=pb.TokenIds(ids=[5]), sampling_params=pb.SamplingParams(stop=["a", "b", "c"])),
     "max_stop_strings=2", "3"),
    ({"prompt": [5], "stop": "toolong"},
     dict(token_ids=pb.TokenIds(ids=[5]), sampling_params=pb.SamplingParams(stop=["toolong"])),
     "max_stop_string_chars=6", "7"),
    ({"prompt": [5], "stop_token_ids": [7, 8, 9]},
     dict(token_ids=pb.TokenIds(ids=[5]),
          sampling_params=pb.SamplingParams(stop_token_ids=[7, 8, 9])),
     "max_stop_token_ids=2", "3"),
    ({"prompt": [5], "n": 4}, dict(token_ids=pb.TokenIds(ids=[5]), n=4), "max_n=3", "4"),
]  # fmt: skip


@pytest.mark.parametrize("body, request_kw, limit, value", OVER)
def test_over_a_limit_is_400_and_invalid_argument(limited, body, request_kw, limit, value):
    r = httpx.post(limited.http + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert limit in message and value in message, message
    with grpc.insecure_channel(limited.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(**request_kw), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert limit in info.value.details() and value in info.value.details()


def test_n_and_top_logprobs_limits():
    with pytest.raises(ValueError, match="max_top_logprobs=2"):
        RequestLimits(max_top_logprobs=2).check([1], SamplingParams(logprobs=3))
    with pytest.raises(ValueError, match="n: 3 is over this server's limit max_n=2"):
        RequestLimits(max_n=2).check([1], SamplingParams(n=3))
    with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1"):
        RequestLimits(max_body_bytes=0)
    RequestLimits().check([1] * 10_000, SamplingParams(max_tokens=10_000))  # None: the engine's


def test_body_over_the_limit_is_413(limited):
    big = {"prompt": "x" * 5000, "max_tokens": 2}
    r = httpx.post(limited.http + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"] == {
        "message": "request body is over this server's limit max_body_bytes=4096",
        "type": "too_large",
        "code": 413,
    }

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    headers = {"content-type": "application/json"}
    r = httpx.post(limited.http + "/v1/completions", content=chunks(), headers=headers)
    assert r.status_code == 413 and "max_body_bytes=4096" in r.json()["error"]["message"]
    r = httpx.post(limited.http + "/v1/nowhere", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    with grpc.insecure_channel(limited.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="z" * 5000), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    prompt, params, ref = limited.h.work[0]
    r = httpx.post(
        limited.http + "/v1/completions",
        json={"prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
              "ignore_eos": True},
        timeout=30,
    )  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref
    assert_drained(limited)


def test_concurrent_streams_per_connection_are_capped(limited):
    """Five streams on one channel with max_concurrent_streams=2: at most two reach the
    server at a time (the others wait in the client), and all five finish exact. On a fresh
    connection some streams go out before the client has read the server's SETTINGS, and the
    server refuses them (UNAVAILABLE): the client's retry policy sends them again (without it
    this test failed about one run in three)."""
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], limited.thread.num_outstanding)
            time.sleep(0.002)

    work = limited.h.work[:5]

    async def run():
        async with GenerationClient(limited.grpc_target) as client:
            calls = [client.complete(p, sp.replace(max_tokens=12), timeout=60) for p, sp, _ in work]
            return await asyncio.gather(*calls)

    watcher = threading.Thread(target=watch)
    with slow_steps(limited.thread, 0.01):
        watcher.start()
        try:
            done = asyncio.run(run())
        finally:
            stop.set()
            watcher.join()
    assert [d.token_ids for d in done] == [limited.h.expected(p, 12) for p, _, _ in work]
    assert peak[0] == 2, peak
    assert_drained(limited)


def test_grpc_message_limit_counts_the_serialized_request(limited):
    request = build_request([5] * 20, SamplingParams(max_tokens=2))
    assert request.ByteSize() < LIMITS.max_body_bytes
    with grpc.insecure_channel(limited.grpc_target) as channel:
        resps = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=10))
    assert resps[-1].usage.completion_tokens == 2


def test_serve_flags_build_the_config(monkeypatch):
    from jbatch.cli import _build_parser
    from serving.flags import hardening_config

    monkeypatch.delenv("JBATCH_API_KEY", raising=False)
    argv = ["serve", "--api-key", "a1", "--api-key", "b2", "--protect-metrics"]
    argv += ["--max-body-bytes", "1000", "--max-tokens-limit", "7", "--max-prompt-tokens", "9"]
    argv += ["--max-concurrent-streams", "3", "--stream-buffer", "5", "--stream-stall-timeout", "2"]
    argv += ["--max-n", "4"]
    config = hardening_config(_build_parser().parse_args(argv))
    assert config["limits"] == RequestLimits(
        max_body_bytes=1000, max_tokens=7, max_prompt_tokens=9, max_concurrent_streams=3, max_n=4
    )
    keys = config["api_keys"]
    assert keys.allows("Bearer a1") and keys.allows("Bearer b2") and keys.protect_metrics
    assert (config["stream_buffer"], config["stream_stall_timeout"]) == (5, 2.0)
    defaults = hardening_config(_build_parser().parse_args(["serve"]))
    assert defaults["limits"] == RequestLimits() and not defaults["api_keys"].enabled
    with pytest.raises(ValueError, match="stream_buffer"):
        hardening_config(_build_parser().parse_args(["serve", "--stream-buffer", "0"]))
