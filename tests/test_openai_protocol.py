"""The OpenAI surface through HTTP: strictness (a field jbatch does not implement is a 400
naming it; the documented ignored fields and "off" values pass) and the official ``openai``
client (chat, streaming chat), on the serving harness's engine (``MockCore``: exact tokens)."""

from __future__ import annotations

import httpx
import openai
import pytest

from serving.chat_template import render_chat
from serving.openai_protocol import IGNORED_FIELDS, NOT_SUPPORTED_YET
from tests.serving_harness import assert_drained, hardened_llm, running_server  # noqa: F401

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox"}]
NOT_OFF = {  # a value of each NOT_SUPPORTED_YET field that would change the output
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "logit_bias": {"5": 100},
    "suffix": "tail",
    "best_of": 2,
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "reasoning_effort": "high",
    "web_search_options": {},
    "verbosity": "low",
}


@pytest.fixture(scope="module")
def server(hardened_llm):  # noqa: F811
    with running_server(hardened_llm) as s:
        s.h = hardened_llm
        yield s


def _chat(**extra) -> dict:
    return {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, **extra}


def test_every_not_supported_field_is_a_400_naming_it(server):
    assert set(NOT_OFF) == set(NOT_SUPPORTED_YET)
    with httpx.Client(base_url=server.http, timeout=30) as http:
        for field, value in NOT_OFF.items():
            r = http.post("/v1/chat/completions", json=_chat(**{field: value}))
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["message"].startswith(f"{field}: not supported yet"), r.text
        r = http.post("/v1/completions", json={"prompt": "x", "frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("frobnicate:")
        image = {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
        content = [{"type": "text", "text": "what is it?"}, image]
        r = http.post(
            "/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": content}])
        )
        assert r.status_code == 400 and "messages[0].content[1]" in r.json()["error"]["message"]
    assert_drained(server)


def test_ignored_fields_and_off_values_change_nothing(server):
    h = server.h
    ids = h.engine.tokenizer.encode(render_chat(h.engine.tokenizer, MESSAGES), False)
    ignored = {"metadata": {"a": "b"}, "store": False, "service_tier": "auto",
               "prompt_cache_key": "k", "safety_identifier": "s", "prediction": None}  # fmt: skip
    assert set(ignored) == set(IGNORED_FIELDS)
    off = {field: values[-1] for field, values in NOT_SUPPORTED_YET.items()}
    with httpx.Client(base_url=server.http, timeout=30) as http:
        for extra in ({}, ignored, off):
            r = http.post("/v1/chat/completions", json=_chat(ignore_eos=True, **extra))
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["token_ids"] == h.expected(ids, 3)
    assert_drained(server)


def test_openai_client_chat_and_streaming_chat(server):
    h = server.h
    ids = h.engine.tokenizer.encode(render_chat(h.engine.tokenizer, MESSAGES), False)
    ref = h.expected(ids, 5)
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=5, temperature=0, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.model_extra["token_ids"] == ref
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, functions=[{"name": "f"}])
    assert info.value.body["message"].startswith("functions: not supported yet")
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=21
        )
    assert_drained(server)
