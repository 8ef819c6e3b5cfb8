"""Generated garbage against both front ends: hypothesis-built ``GenerateRequest`` messages
(random fields at the edges of their types, NaN / inf, invalid UTF-8 in stop strings, empty
oneofs, truncated and random bytes) over gRPC, and schemathesis against the HTTP server's own
OpenAPI schema. Never INTERNAL / 5xx, every call answered within its deadline, and the server
still answers exactly afterwards with no page or slot left behind."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.limits import RequestLimits
from serving.proto.jbatch.v1 import generation_pb2 as pb
from tests.serving_harness import assert_drained, hardened_llm, running_server  # noqa: F401

DEADLINE_S = 10.0
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # a message over max_body_bytes
    grpc.StatusCode.NOT_FOUND,  # `resume` set: no restored request of that id (resumable.py)
}
# Short generations keep the fuzzing fast; generated max_tokens above it are refused (400).
LIMITS = RequestLimits(max_tokens=8, max_body_bytes=1 << 16)
_FD = FieldDescriptor
_INT_RANGES = {
    _FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    _FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    _FD.TYPE_UINT32: (0, 2**32 - 1),
    _FD.TYPE_UINT64: (0, 2**64 - 1),
}


@pytest.fixture(scope="module")
def fuzzed(hardened_llm):  # noqa: F811
    with running_server(hardened_llm, limits=LIMITS) as s:
        s.h = hardened_llm
        yield s


def _scalar(fd: FieldDescriptor) -> st.SearchStrategy:
    if fd.type in _INT_RANGES:
        lo, hi = _INT_RANGES[fd.type]
        return st.one_of(st.integers(-3, 40), st.integers(lo, hi), st.sampled_from([lo, hi]))
    if fd.type in (_FD.TYPE_FLOAT, _FD.TYPE_DOUBLE):
        return st.one_of(st.floats(-3, 3, width=32), st.floats(width=32))  # NaN and inf too
    if fd.type == _FD.TYPE_BOOL:
        return st.booleans()
    return st.text(max_size=12)


def _fields(descriptor) -> st.SearchStrategy[dict]:
    """Any subset of the message's scalar fields, each at any value of its type."""
    strategies = {}
    for fd in descriptor.fields:
        if fd.type == _FD.TYPE_MESSAGE:
            continue
        values = st.lists(_scalar(fd), max_size=4) if fd.is_repeated else _scalar(fd)
        strategies[fd.name] = values
    return st.fixed_dictionaries({}, optional=strategies)


_PARAMS = pb.SamplingParams.DESCRIPTOR
_SANE_PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(-1, 50),
        "max_tokens": st.integers(1, 8),
        "seed": st.integers(0, 2**32 - 1),
        "ignore_eos": st.booleans(),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=2),
    },
)


@st.composite
def generate_requests(draw) -> bytes:
    """Serialized GenerateRequest bytes, sometimes damaged on purpose."""
    req = pb.GenerateRequest(**draw(_fields(pb.GenerateRequest.DESCRIPTOR)))
    if draw(st.booleans()):  # wild: any field at any value
        req.sampling_params.CopyFrom(pb.SamplingParams(**draw(_fields(_PARAMS))))
        ids = st.lists(_scalar(_ids_field()), min_size=1, max_size=24)
    else:  # mostly valid, so that generation itself is exercised
        req.sampling_params.CopyFrom(pb.SamplingParams(**draw(_SANE_PARAMS)))
        req.n, req.resume = draw(st.integers(0, 3)), False  # a new request (0: n unset)
        ids = st.lists(st.integers(0, 511), min_size=1, max_size=24)
    prompt = draw(st.sampled_from(["none", "text", "ids", "ids", "empty_ids"]))
    if prompt == "text":
        req.text = draw(st.text(max_size=64))
    elif prompt == "ids":
        req.token_ids.ids.extend(draw(ids))
    elif prompt == "empty_ids":
        req.token_ids.SetInParent()
    data = req.SerializeToString()
    damage = draw(st.sampled_from(["none"] * 4 + ["bad_utf8_stop", "truncate", "random"]))
    if damage == "bad_utf8_stop":  # field 2 (sampling_params) holding a stop with bad UTF-8
        stop = _tag(pb.SamplingParams.DESCRIPTOR.fields_by_name["stop"].number, 2)
        bad = draw(st.sampled_from([b"\xff\xfe", b"\xc3", b"ok\xed\xa0\x80"]))
        inner = stop + bytes([len(bad)]) + bad
        params = _tag(pb.GenerateRequest.DESCRIPTOR.fields_by_name["sampling_params"].number, 2)
        data += params + bytes([len(inner)]) + inner
    elif damage == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "random":
        data = draw(st.binary(max_size=64))
    return data


def _ids_field() -> FieldDescriptor:
    return pb.TokenIds.DESCRIPTOR.fields_by_name["ids"]


def _tag(number: int, wire_type: int) -> bytes:
    return bytes([(number << 3) | wire_type])


def test_generated_grpc_requests_never_internal(fuzzed):
    seen: dict[grpc.StatusCode, int] = {}
    with grpc.insecure_channel(fuzzed.grpc_target) as channel:
        generate = channel.unary_stream(
            "/jbatch.v1.Generation/Generate", response_deserializer=pb.GenerateResponse.FromString
        )

        @settings(
            max_examples=300, deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )  # fmt: skip
        @given(data=generate_requests())
        def one(data: bytes) -> None:
            t0 = time.monotonic()
            try:
                list(generate(data, timeout=DEADLINE_S))
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
                assert code in ALLOWED, (code, e.details(), data)
            assert time.monotonic() - t0 < DEADLINE_S
            seen[code] = seen.get(code, 0) + 1

        one()
    assert sum(seen.values()) >= 300
    assert seen.get(grpc.StatusCode.OK) and seen.get(grpc.StatusCode.INVALID_ARGUMENT), seen
    _still_exact(fuzzed)


def _still_exact(s) -> None:
    prompt, params, ref = s.h.work[3]
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(s.http + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref
    assert_drained(s)


def test_undecodable_bytes_are_invalid_argument(fuzzed):
    stop = _tag(pb.SamplingParams.DESCRIPTOR.fields_by_name["stop"].number, 2) + b"\x02\xff\xfe"
    params = _tag(pb.GenerateRequest.DESCRIPTOR.fields_by_name["sampling_params"].number, 2)
    data = pb.GenerateRequest(text="hi").SerializeToString() + params + bytes([len(stop)]) + stop
    with grpc.insecure_channel(fuzzed.grpc_target) as channel:
        generate = channel.unary_stream("/jbatch.v1.Generation/Generate")
        with pytest.raises(grpc.RpcError) as info:
            list(generate(data, timeout=DEADLINE_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in info.value.details()
