"""Structured output through the servers: the official ``openai`` client (``response_format``
json_schema / json_object, jbatch's ``structured_outputs``), raw HTTP 400s naming the problem,
and the gRPC ``structured`` oneof (the session MockCore engine with a real tokenizer)."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pytest

from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from tests.serving_harness import assert_drained, hardened_llm, running_server

__all__ = ["hardened_llm"]

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["fox", "dog"]},
    },
    "required": ["word", "count", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(hardened_llm):
    with running_server(hardened_llm) as running:
        yield running
        assert_drained(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)


def test_chat_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the fox"}], max_tokens=64,
        response_format=fmt, temperature=0,
    )  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_object(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "keys"}], max_tokens=200, stream=True,
        response_format={"type": "json_object"}, temperature=0,
        extra_body={"structured_outputs": None},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert text.startswith("{")
    if finish == "stop":  # a free-form object may run out of tokens
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "spec, check",
    [
        ({"regex": "(fox|dog)-[0-9]{2}"}, lambda t: re.fullmatch("(fox|dog)-[0-9]{2}", t)),
        ({"choice": ["quick", "lazy dog"]}, lambda t: t in ("quick", "lazy dog")),
        ({"grammar": 'start: "<" word (" " word)* ">"\nword: "fox" | "dog"'},
         lambda t: re.fullmatch("<(fox|dog)( (fox|dog))*>", t)),
    ],
)  # fmt: skip
def test_completions_structured_outputs(client, spec, check):
    resp = client.completions.create(
        model="tiny", prompt="the quick", max_tokens=40, temperature=0.8, seed=3,
        extra_body={"structured_outputs": spec},
    )  # fmt: skip
    text = resp.choices[0].text
    assert check(text), text
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"structured_outputs": {"json": {"type": "object"}}, "response_format": {}},
         "at most one"),
    ],
)  # fmt: skip
def test_bad_specs_are_400_naming_the_problem(server, body, needle):
    full = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **body}
    r = httpx.post(server.http + "/v1/completions", json=full, timeout=10)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_grpc_structured_oneof(server):
    params = pb.SamplingParams(temperature=0.0, max_tokens=40)
    params.choice.choices.extend(["brown fox", "lazy"])
    request = pb.GenerateRequest(request_id="g", text="the", sampling_params=params)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        text = "".join(r.text for r in stub.Generate(request, timeout=10))
        assert text in ("brown fox", "lazy")
        bad = pb.SamplingParams(regex="[unclosed")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="x", sampling_params=bad), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured.regex" in err.value.details()
