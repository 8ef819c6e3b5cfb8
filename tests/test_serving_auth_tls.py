"""API keys and TLS on both front ends, with real clients: the ``openai`` package, raw HTTP
(httpx), grpcio stubs and ``jbatch client``. One server with two keys and a self-signed
certificate made at run time; a second, plain one with ``protect_metrics``."""

from __future__ import annotations

import asyncio
import logging
import ssl
import subprocess
import sys

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from serving.auth import ApiKeys
from serving.client import GenerationClient, build_request
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.proto.jbatch.v1 import generation_pb2_grpc as pb_grpc
from serving.server import ServeConfig, Server
from tests.serving_harness import assert_drained, hardened_llm, running_server  # noqa: F401
from tests.tls_cert import self_signed

KEYS = ("key-one-3f9a", "key-two-77c1")


@pytest.fixture(scope="module")
def secure(hardened_llm, tmp_path_factory):  # noqa: F811
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    api_keys = ApiKeys(KEYS)
    with running_server(hardened_llm, api_keys=api_keys, tls_cert=str(cert), tls_key=str(key)) as s:
        s.cert = cert
        s.work = hardened_llm.work
        with open(cert, "rb") as f:
            s.credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        yield s


def _stub(s, channel_kind=grpc.secure_channel):
    return channel_kind(s.grpc_target, s.credentials)


def _generate_ids(s, metadata) -> list[int]:
    prompt, params, _ = s.work[0]
    with _stub(s) as channel:
        stub = pb_grpc.GenerationStub(channel)
        resps = stub.Generate(build_request(prompt, params), timeout=30, metadata=metadata)
        return [t for r in resps for t in r.token_ids]


def test_openai_client_needs_the_key(secure):
    prompt, params, ref = secure.work[1]
    verify = ssl.create_default_context(cafile=str(secure.cert))
    # Closed at the end: an open TLS keep-alive would hold the server's shutdown (asyncio's
    # SSL shutdown timeout).
    with httpx.Client(verify=verify) as http_client:
        url = secure.http + "/v1"
        client = openai.OpenAI(base_url=url, api_key=KEYS[1], http_client=http_client)
        done = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=params.max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert done.choices[0].model_extra["token_ids"] == ref
        assert client.models.list().data[0].id == "tiny"
        chunks = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        assert chunks.response.status_code == 200
        chunks.close()
        wrong = openai.OpenAI(base_url=url, api_key="nope", http_client=http_client)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.body["type"] == "unauthenticated"
    assert "Bearer" in info.value.body["message"]
    assert_drained(secure)


def test_raw_http_auth_and_open_paths(secure):
    verify = ssl.create_default_context(cafile=str(secure.cert))
    with httpx.Client(verify=verify, timeout=30) as http:
        body = {"prompt": [5, 6], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEYS[0]}"},
                        {"Authorization": f"Bearer {KEYS[0]}x"}):  # fmt: skip
            r = http.post(secure.http + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            assert error["type"] == "unauthenticated" and error["code"] == 401
            assert KEYS[0] not in r.text
        assert http.get(secure.http + "/v1/models").status_code == 401
        assert http.get(secure.http + "/openapi.json").status_code == 401
        assert http.get(secure.http + "/health").json() == {"status": "ok"}
        assert http.get(secure.http + "/metrics").status_code == 200
        ok = http.post(
            secure.http + "/v1/completions",
            json=body,
            headers={"authorization": f"bearer {KEYS[0]}"},
        )
        assert ok.status_code == 200, ok.text
    with pytest.raises(httpx.TransportError):  # the port speaks TLS only
        httpx.get(secure.http.replace("https:", "http:") + "/health", timeout=5)
    with pytest.raises(httpx.TransportError):  # and a client that does not trust the cert fails
        httpx.get(secure.http + "/health", timeout=5)
    metrics = httpx.get(secure.http + "/metrics", verify=verify).text
    assert 'jbatch_requests_total{finish_reason="",status="unauthenticated"}' in metrics


def test_grpc_auth_health_and_reflection(secure):
    ref = secure.work[0][2]
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEYS[0]),)):
        with pytest.raises(grpc.RpcError) as info:
            _generate_ids(secure, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer" in info.value.details()
    assert _generate_ids(secure, (("authorization", f"Bearer {KEYS[1]}"),)) == ref
    with _stub(secure) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError):  # reflection needs the key too
            ProtoReflectionDescriptorDatabase(channel).get_services()
    with grpc.insecure_channel(secure.grpc_target) as channel:  # plaintext to a TLS port
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert_drained(secure)


def test_generation_client_and_cli_client_with_tls_and_key(secure, monkeypatch):
    prompt, params, ref = secure.work[2]

    async def run():
        async with GenerationClient(
            secure.grpc_target, tls_ca=str(secure.cert), api_key=KEYS[0]
        ) as client:
            info = await client.model_info()
            done = await client.complete(prompt, params, timeout=30)
        return info, done

    info, done = asyncio.run(run())
    assert done.token_ids == ref and info.model == "tiny"
    cmd = [sys.executable, "-m", "jbatch.cli", "client", "--target", secure.grpc_target]
    cmd += ["--tls-ca", str(secure.cert), "--max-tokens", "3", "--ignore-eos", "hello"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**_env(), "JBATCH_API_KEY": KEYS[1]})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "length: " in out.stderr
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "JBATCH_API_KEY"}


def test_keys_are_never_shown(caplog, monkeypatch):
    keys = ApiKeys(KEYS)
    config = ServeConfig(api_keys=keys)
    assert not any(k in repr(config) or k in repr(keys) for k in KEYS)
    assert keys.allows(f"Bearer {KEYS[0]}") and keys.allows(f"bearer  {KEYS[1]} ")
    assert not keys.allows(f"Bearer {KEYS[0][:-1]}") and not keys.allows(None)
    assert ApiKeys().allows(None), "no keys: auth is off"
    monkeypatch.setenv("JBATCH_API_KEY", "from-env")
    assert ApiKeys.from_flags(None).allows("Bearer from-env")
    assert not ApiKeys.from_flags(["flag-key"]).allows("Bearer from-env")
    with pytest.raises(ValueError, match="api key #2"):
        ApiKeys(["ok", "has space"])


def test_protect_metrics_closes_metrics(secure, caplog):
    caplog.set_level(logging.DEBUG)
    keys = secure.server.ctx.api_keys
    verify = ssl.create_default_context(cafile=str(secure.cert))
    keys.protect_metrics = True
    try:
        with httpx.Client(verify=verify, timeout=30) as http:
            assert http.get(secure.http + "/metrics").status_code == 401
            headers = {"Authorization": f"Bearer {KEYS[0]}"}
            assert http.get(secure.http + "/metrics", headers=headers).status_code == 200
            assert http.get(secure.http + "/health").status_code == 200
            r = http.post(secure.http + "/v1/completions", json={"prompt": [5], "max_tokens": 2})
            assert r.status_code == 401
    finally:
        keys.protect_metrics = False
    assert not any(k in caplog.text for k in KEYS)
    config = ServeConfig(metrics_port=0, api_keys=ApiKeys(KEYS, protect_metrics=True))
    with pytest.raises(ValueError, match="metrics_port"):
        asyncio.run(Server(config).start())
