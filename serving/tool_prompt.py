"""Tools in the prompt: through the chat template when it renders ``tools``, else jbatch's
default tools prompt in the system message; and tool turns in the history.

- A template renders tools when a probe tool's name shows up in what it renders with that tool
  (checked once per template). Then it gets ``tools`` as sent, and the history as HF templates
  expect it: assistant ``tool_calls`` with their ``arguments`` decoded to objects, ``role:
  tool`` messages with their ``tool_call_id``.
- Otherwise (many templates ignore ``tools``) jbatch writes the tools into the system message
  (appended to the first one, or a new one in front; in front of the first user turn for a
  template that refuses a system role): :func:`tools_prompt`, each function's JSON (name,
  description, parameters schema) and how to call it in the output format's own syntax
  (``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). The history is
  written the same way: an assistant turn's calls as call text after its content, and tool
  results as a user turn of ``<tool_response>...</tool_response>`` blocks (consecutive
  results in one turn, so roles still alternate).
"""

from __future__ import annotations

import functools
import json
import types
from typing import Any

from jbatch.tokenizer import Tokenizer
from serving.chat_template import ChatTemplateError, render_chat
from serving.tool_parsers import HermesParser, ToolParser
from serving.tool_request import ToolRequest

PROBE = "jbatch_probe_function_7f3a"
_PROBE_TOOL = {"type": "function", "function": {"name": PROBE, "description": "", "parameters": {}}}


def tools_prompt(tools: list[dict[str, Any]], parser: type[ToolParser], parallel: bool) -> str:
    """jbatch's default tools prompt (see the module doc)."""
    lines = [
        "# Tools",
        "",
        "You can call the functions below. Each is a JSON object: its name, what it does, and "
        "a JSON Schema of its arguments (parameters).",
        "",
    ]
    for tool in tools:
        f = tool["function"]
        entry = {"name": f["name"], "description": f.get("description", "")}
        entry["parameters"] = f.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    example = parser.call_text("<function name>", "<arguments: a JSON object matching parameters>")
    lines += ["", "To call a function, write the call exactly like this:", example]
    lines.append(
        "To call several functions, write one call after another."
        if parallel
        else "Call at most one function in a reply."
    )
    lines.append("Each call's result comes back to you in the next message.")
    return "\n".join(lines)


def renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's chat template writes the ``tools`` it is given."""
    return _renders_tools(tokenizer.chat_template or "")


@functools.lru_cache(maxsize=16)
def _renders_tools(template: str) -> bool:
    fake = types.SimpleNamespace(chat_template=template, bos_token="", eos_token="")
    for messages in (
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        [{"role": "user", "content": "u"}],
    ):
        try:
            return PROBE in render_chat(fake, messages, True, tools=[_PROBE_TOOL])
        except ChatTemplateError:
            continue
    return False


def check_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with tool turns checked and assistant call ``arguments`` decoded."""
    out = []
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content: a tool message's content is a string")
            if not isinstance(m.get("tool_call_id"), str):
                raise ValueError(f"messages[{i}].tool_call_id: a tool message needs one (string)")
        calls = m.get("tool_calls")
        if calls is not None:
            decoded = [_decoded_call(f"messages[{i}]", j, c) for j, c in enumerate(calls)]
            m = {**m, "tool_calls": decoded}
        out.append(m)
    return out


def _decoded_call(where: str, j: int, call: Any) -> dict[str, Any]:
    where = f"{where}.tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function must be an object with a string name")
    args = function.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return {**call, "type": "function", "function": {**function, "arguments": args}}


def inline_history(
    messages: list[dict[str, Any]], parser: type[ToolParser]
) -> list[dict[str, Any]]:
    """The history as plain turns for a template that knows nothing of tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        if m.get("tool_calls"):
            calls = [parser.call_text(c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]  # fmt: skip
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def render_tool_chat(
    tokenizer: Tokenizer | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: ToolRequest | None,
) -> str:
    """The prompt of a chat request with its tools and tool turns (see the module doc)."""
    messages = check_history(messages)
    has_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if tokenizer is None or not tokenizer.chat_template or renders_tools(tokenizer):
        listed = tools.tools if tools is not None else None
        return render_chat(tokenizer, messages, add_generation_prompt, tools=listed)
    parser = (tools.parser if tools is not None else None) or HermesParser
    if has_turns:
        messages = inline_history(messages, parser)
    if tools is None:
        return render_chat(tokenizer, messages, add_generation_prompt)
    prompt = tools_prompt(tools.tools, parser, tools.parallel)
    if messages and messages[0].get("role") == "system":
        system = messages[0]
        content = f"{system['content']}\n\n{prompt}" if system.get("content") else prompt
        return render_chat(
            tokenizer, [{**system, "content": content}, *messages[1:]], add_generation_prompt
        )
    try:
        return render_chat(
            tokenizer, [{"role": "system", "content": prompt}, *messages], add_generation_prompt
        )
    except ChatTemplateError:  # no system role: the first user turn carries the tools
        first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first is None:
            raise
        m = messages[first]
        messages = [*messages[:first], {**m, "content": f"{prompt}\n\n{m['content']}"},
                    *messages[first + 1 :]]  # fmt: skip
        return render_chat(tokenizer, messages, add_generation_prompt)
