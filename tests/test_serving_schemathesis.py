"""schemathesis against the HTTP server's own OpenAPI schema (``/openapi.json``): every
operation (>= 100 generated bodies for each POST; the GETs take no input), no 5xx, no hang,
and the server answers exactly afterwards with no page or slot left behind."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from serving.limits import RequestLimits
from tests.serving_harness import assert_drained, hardened_llm, running_server  # noqa: F401

# Short generations keep the run fast; generated max_tokens above it are refused (400).
LIMITS = RequestLimits(max_tokens=8, max_body_bytes=1 << 16)
CALLS: dict[str, int] = {}


@pytest.fixture(scope="module")
def http_server(hardened_llm):  # noqa: F811
    with running_server(hardened_llm, limits=LIMITS) as s:
        s.h = hardened_llm
        yield s


@pytest.fixture(scope="module")
def api_schema(http_server):
    return schemathesis.openapi.from_url(http_server.http + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=100, deadline=None, derandomize=True, database=None,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip
def test_generated_http_requests_never_5xx(case):
    response = case.call(timeout=10)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    key = f"{case.method} {case.path}"
    CALLS[key] = CALLS.get(key, 0) + 1


def test_every_operation_was_fuzzed_and_the_server_is_intact(http_server):
    # The two POST operations take bodies: >= 100 generated each. The three GETs take no input
    # at all, so every request to them is the same one (schemathesis also tries the other
    # methods on every path: 405, never 5xx).
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert CALLS.get(f"POST {path}", 0) >= 100, CALLS
    for path in ("/health", "/metrics", "/v1/models"):
        assert CALLS.get(f"GET {path}", 0) >= 1, CALLS
    prompt, params, ref = http_server.h.work[5]
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(http_server.http + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref
    assert_drained(http_server)
