"""Tool calling in /v1/chat/completions: the parsers (fixed strings, any chunking), the prompt
(a template that renders tools, jbatch's default tools prompt, tool turns in the history), and
through the server with the official ``openai`` client on the harness engine (``MockCore``,
whose constrained outputs follow the grammar): ``required`` and named calls validate against
their schema, ``auto`` parses a canned output, streamed deltas assemble to the whole, 400s."""

from __future__ import annotations

import itertools
import json
import types

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.openai_protocol import ChatCompletionRequest, response_body, translate_chat
from serving.request_stream import Delta
from serving.tool_output import ToolCalling
from serving.tool_parsers import HermesParser, Llama3JsonParser, ParsedCall, parser_for
from serving.tool_prompt import PROBE, renders_tools
from tests.serving_harness import assert_drained, hardened_llm, running_server

__all__ = ["hardened_llm"]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
HERMES_TEXT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
    '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n'
)
LLAMA_TEXT = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "f"}'


def _run(parser_cls, chunks: list[str]) -> list:
    parser, out = parser_cls(), []
    for chunk in chunks:
        out += parser.feed(chunk)
    return _merged(out + parser.finish())


def _merged(pieces: list) -> list:
    """Adjacent text pieces joined (the chunking decides where text splits, nothing else)."""
    out: list = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


@pytest.mark.parametrize(
    "cls, text, expected",
    [
        (HermesParser, HERMES_TEXT, ["Let me look.\n", ParsedCall("get_weather",
         '{"city": "Oslo", "days": 2}'), "\n", ParsedCall("get_time", '{"zone": "CET"}'), "\n"]),
        (HermesParser, "a <tool_ b", ["a <tool_ b"]),
        (HermesParser, "<tool_call>{oops}</tool_call>", ["<tool_call>{oops}</tool_call>"]),
        (HermesParser, '<tool_call>{"name": "f"}', [ParsedCall("f", "{}")]),  # cut off: a call
        (Llama3JsonParser, LLAMA_TEXT,
         [ParsedCall("get_time", '{"zone": "UTC"}'), ParsedCall("f", "{}")]),
        (Llama3JsonParser, " It is {sunny}", [" It is {sunny}"]),
        (Llama3JsonParser, ' {"no_name": 1} x', [' {"no_name": 1} x']),
        (Llama3JsonParser, '{"name": "f", "arguments": {"a"', ['{"name": "f", "arguments": {"a"']),
    ],
)  # fmt: skip
def test_parsers_on_fixed_strings(cls, text, expected):
    assert _run(cls, [text]) == expected


@settings(max_examples=60, deadline=None)
@given(
    text=st.sampled_from([HERMES_TEXT, LLAMA_TEXT, "plain <tool_call text", ' {"name": 1}']),
    cuts=st.lists(st.integers(0, 120), max_size=12),
)
def test_any_chunking_gives_the_same_pieces_and_message(text, cuts):
    bounds = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for cls in (HermesParser, Llama3JsonParser):
        assert _run(cls, chunks) == _run(cls, [text])
        calling = ToolCalling(cls)
        whole, _ = calling.whole(Delta([], text, "stop"))
        stream, content, calls = calling.stream(), "", []
        for i, chunk in enumerate(chunks or [""]):
            last = i == len(chunks or [""]) - 1
            fields, _ = stream.feed(Delta([], chunk, "stop" if last else None))
            content += fields.get("content", "")
            calls += [c["function"] for c in fields.get("tool_calls", ())]
        assert (content or None) == whole["content"]
        assert calls == [c["function"] for c in whole.get("tool_calls", ())]


def test_whole_message_content_calls_and_finish_reason():
    calling = ToolCalling(HermesParser)
    message, delta = calling.whole(Delta([], HERMES_TEXT, "stop"))
    assert message["content"] == "Let me look." and delta.finish_reason == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    calls = message["tool_calls"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    one, cut = ToolCalling(HermesParser, max_calls=1).whole(Delta([], HERMES_TEXT, "length"))
    assert len(one["tool_calls"]) == 1 and cut.finish_reason == "length"
    plain, d = calling.whole(Delta([], "just text ", "stop"))
    assert plain == {"content": "just text "} and d.finish_reason == "stop"


def test_parser_choice_from_the_template():
    assert parser_for("auto", "{{ '<tool_call>' }}") is HermesParser
    assert parser_for("auto", "<|start_header_id|>ipython<|python_tag|>") is Llama3JsonParser
    assert parser_for("auto", None) is HermesParser and parser_for("none", "x") is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        parser_for("mistral", None)


# A template that renders tools and tool turns, in the way HF templates do.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}\n{% endfor %}"
)
HISTORY = [
    *MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "<windy & cold>"},
]  # fmt: skip


def _prompt(tokenizer, **body) -> str:
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, **body})
    return translate_chat(req, tokenizer).prompt


def test_prompt_template_with_tools_and_default_tools_prompt(hardened_llm):
    harness = hardened_llm.engine.tokenizer  # its template ignores tools
    templated = types.SimpleNamespace(chat_template=TOOL_TEMPLATE, bos_token="", eos_token="")
    assert renders_tools(templated) and not renders_tools(harness)
    text = _prompt(templated, tools=TOOLS)
    assert text.count("<tools>") == 1 and json.dumps(TOOLS[0]) in text  # HF tojson: not sorted
    assert '[get_weather {"city": "Paris", "days": 1}]' in text and "<windy & cold>" in text
    assert PROBE not in text
    text = _prompt(harness, tools=TOOLS)
    assert text.startswith("<system># Tools") and '{"name": "get_time", "description": ""' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in text
    assert "<user><tool_response>\nsunny\n</tool_response>\n<tool_response>\n<windy" in text
    assert "<assistant>None" not in text and "several functions" in text
    one = _prompt(harness, tools=TOOLS, parallel_tool_calls=False)
    assert "at most one function" in one
    none = _prompt(harness, tools=TOOLS, tool_choice="none")
    assert none == text  # tools stay in the prompt; the output is not parsed
    history_only = _prompt(harness)
    assert "# Tools" not in history_only and "<tool_response>" in history_only


def test_auto_parses_a_canned_output_unit_level(hardened_llm):
    tok = hardened_llm.engine.tokenizer
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    t = translate_chat(req, tok)
    assert t.params.structured is None and t.tools == ToolCalling(HermesParser)
    body = response_body({"id": "x"}, [Delta([1], HERMES_TEXT, "stop", None, 3, 1)], True, t.tools)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["days"] == 2
    req = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    )
    assert translate_chat(req, tok).tools is None


# ---- through the server ----------------------------------------------------------------
# The harness engine's sequences are short (256 tokens of a 512-token vocabulary): through the
# server, a template that renders only the tools' names keeps prompts small.
SERVER_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def server(hardened_llm):
    tokenizer = hardened_llm.engine.tokenizer
    saved, tokenizer.chat_template = tokenizer.chat_template, SERVER_TEMPLATE
    try:
        with running_server(hardened_llm) as running:
            yield running
            assert_drained(running)
    finally:
        tokenizer.chat_template = saved


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)


def _create(client, **kwargs):
    args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0)
    return client.chat.completions.create(**(args | kwargs))


def _assembled(chunks) -> tuple[str | None, list[dict], str]:
    """A streamed response's content, calls and finish reason, as a client assembles them."""
    content, calls, finish = "", {}, None
    for c in chunks:
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate_and_stream_the_same(client, parallel):
    kwargs = dict(tool_choice="required", parallel_tool_calls=parallel)
    done = _create(client, **kwargs).choices[0]
    assert done.finish_reason == "tool_calls", (done.message, done.model_extra)
    assert done.message.content is None
    calls = done.message.tool_calls
    assert calls and (len(calls) > 1) == parallel  # greedy: two calls when it may
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = _assembled(_create(client, stream=True, **kwargs))
    whole = [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    assert streamed == (None, whole, "tool_calls")


def test_named_function_is_called_once(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in (1, 2):
        done = _create(client, tool_choice=named, temperature=0.9, seed=seed).choices[0]
        (call,) = done.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_auto_parses_calls_end_to_end_streamed_and_whole(client):
    canned = {"structured_outputs": {"choice": [HERMES_TEXT]}}  # the mock writes exactly this
    done = _create(client, extra_body=canned).choices[0]
    assert done.message.content == "Let me look." and done.finish_reason == "tool_calls"
    names = [c.function.name for c in done.message.tool_calls]
    assert names == ["get_weather", "get_time"]
    streamed = _assembled(_create(client, stream=True, extra_body=canned))
    whole = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in done.message.tool_calls]  # fmt: skip
    assert streamed == ("Let me look.", whole, "tool_calls")
    history = [*HISTORY, {"role": "assistant", "content": "It is sunny."}]
    plain = _create(client, messages=history, tool_choice="none", max_tokens=4)
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]: only function tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
          {"type": "object", "properties": {"a": {"type": "strin"}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name: 'get_weather' is given twice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name: 'nope'"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be one of"),
        ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
          "arguments": "{no"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_field(server, extra, needle):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(server.http + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_tools_on_completions_are_unknown(server):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "tools": TOOLS}
    r = httpx.post(server.http + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools: unknown")


def test_llama3_json_parser_through_the_server(server, client):
    ctx = server.server.ctx
    ctx.tool_call_parser = "llama3_json"  # as `jbatch serve --tool-call-parser llama3_json`
    try:
        done = _create(client, tool_choice="required").choices[0]
        canned = {"structured_outputs": {"choice": [LLAMA_TEXT]}}
        auto = _create(client, extra_body=canned).choices[0]
    finally:
        ctx.tool_call_parser = "auto"
    assert done.finish_reason == "tool_calls" and done.message.content is None
    for call in done.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert [c.function.name for c in auto.message.tool_calls] == ["get_time", "f"]
