"""Tool-call formats: parse a model's output into text and calls, incrementally, and build the
grammar that forces a call in that format (``tool_choice`` ``required`` or a named function).

One class per format, all with the same streaming interface: :meth:`ToolParser.feed` takes
the next piece of output text and returns what is now certain — plain text (``str``) and
complete calls (:class:`ParsedCall`), in order; :meth:`ToolParser.finish` returns the rest at
the end of the output. Text that may still turn out to be the start of a call is held back.
The pieces depend only on the concatenated text, not on how it was cut (the tests feed random
chunkings), so a streamed response assembles to exactly the non-streamed one.

- ``hermes`` (Qwen2.5, Qwen3, Hermes, and jbatch's default tools prompt):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them.
- ``llama3_json`` (Llama 3.1 - 3.3 JSON tool calling): the output *is* the call, a JSON object
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``); several are
  separated by ``;``. Output that does not start with ``{`` is plain text.

A block that does not hold a valid call (bad JSON, no string ``name``, arguments that are not
an object) is passed through as text, unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

PYTHON_TAG = "<|python_tag|>"
# llguidance JSON options for the forced calls: the separators models are trained on (Python's
# json.dumps), and no free whitespace, so a call cannot wander into a whitespace run.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


Piece = str | ParsedCall


def call_from(obj: Any, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded JSON value, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that ``marker`` starts with (a possible start)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _function_schema(name: str, parameters: dict[str, Any], argument_key: str) -> str:
    """One call's JSON Schema. The parameters' definitions move to its root, where their
    ``#/$defs/...`` references now point."""
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    parameters = {k: v for k, v in parameters.items() if k not in defs}
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, argument_key: parameters},
        "required": ["name", argument_key],
        "additionalProperties": False,
        "x-guidance": JSON_STYLE,
        **defs,
    }
    return json.dumps(schema, ensure_ascii=False)


class ToolParser:
    """One output's parser (a fresh instance per request); subclasses set the format."""

    name: ClassVar[str]
    argument_key: ClassVar[str]  # what the format calls the arguments
    call_separator: ClassVar[str]  # between two forced calls

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    @classmethod
    def call_text(cls, name: str, arguments: dict[str, Any] | str) -> str:
        """One call written in this format (the default tools prompt and history use it)."""
        raise NotImplementedError

    @classmethod
    def _call_rule(cls) -> str:
        """The Lark rule around ``fn`` (one function's JSON object)."""
        raise NotImplementedError

    @classmethod
    def grammar(cls, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of one call, or one or more when ``parallel``,
        to one of ``functions`` (name, parameters schema) with arguments matching its schema."""
        sep = json.dumps(cls.call_separator)
        lines = ["start: call" + (f" ({sep} call)*" if parallel else ""), cls._call_rule()]
        lines.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(functions))))
        for i, (name, params) in enumerate(functions):
            lines.append(f"fn_{i}: %json {_function_schema(name, params, cls.argument_key)}")
        return "\n".join(lines) + "\n"


class HermesParser(ToolParser):
    name = "hermes"
    argument_key = "arguments"
    call_separator = "\n"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self.START)
                if i < 0:
                    cut = len(self._buf) - _held_prefix(self._buf, self.START)
                    out.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                out.append(self._buf[:i])
                self._buf, self._in_call = self._buf[i + len(self.START) :], True
                continue
            j = self._buf.find(self.END)
            if j < 0:
                break
            body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(self.END) :], False
            out.append(self._call(body) or self.START + body + self.END)
        return [p for p in out if p]

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if not self._in_call:
            return [rest] if rest else []
        self._in_call = False  # no closing tag: a call if the rest is one, else text
        return [self._call(rest) or self.START + rest]

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        try:
            return call_from(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            return None

    @classmethod
    def call_text(cls, name: str, arguments: dict[str, Any] | str) -> str:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return f'{cls.START}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{cls.END}'

    @classmethod
    def _call_rule(cls) -> str:
        return f"call: {json.dumps(cls.START + chr(10))} fn {json.dumps(chr(10) + cls.END)}"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    argument_key = "parameters"
    call_separator = "; "
    _decoder = json.JSONDecoder()

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start -> calls (JSON objects) | text
        self._lead = ""  # what "start" consumed before the first object (blanks, the tag)
        self._calls = 0

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._state != "text":
            step = self._start() if self._state == "start" else self._next_call()
            if step is None:
                break
            out.extend(step)
        if self._state == "text":
            out.append(self._buf)
            self._buf = ""
        return [p for p in out if p]

    def _start(self) -> list[Piece] | None:
        s = self._buf.lstrip()
        if not s or (PYTHON_TAG.startswith(s) and s != PYTHON_TAG):
            return None  # nothing yet, or maybe the tag
        body = s[len(PYTHON_TAG) :] if s.startswith(PYTHON_TAG) else s
        if body.lstrip()[:1] == "{":
            self._state, self._lead = "calls", self._buf[: len(self._buf) - len(body)]
            self._buf = body
        elif body.strip():
            self._state = "text"  # plain text: all of it, as written
        else:
            return None  # the tag, then nothing yet
        return []

    def _next_call(self) -> list[Piece] | None:
        s = self._buf.lstrip(" \t\r\n;" if self._calls else " \t\r\n")
        if not s:
            return None
        try:
            obj, end = self._decoder.raw_decode(s) if s[0] == "{" else (None, 0)
        except json.JSONDecodeError:
            return None  # not complete yet (or not JSON: then text at the end)
        call = call_from(obj, ("parameters", "arguments"))
        if call is None:  # text from here on (with what came before it if no call did)
            self._state, self._buf = "text", s if self._calls else self._lead + s
            self._lead = ""
            return []
        self._buf, self._calls = s[end:], self._calls + 1
        return [call]

    def finish(self) -> list[Piece]:
        rest, self._buf, self._state = self._buf, "", "text"
        if self._calls:  # after the calls: what is left, less the separators
            rest = rest.lstrip(" \t\r\n;")
        else:  # no call came of it: all of it is text, the tag included
            rest, self._lead = self._lead + rest, ""
        return [rest] if rest else []

    @classmethod
    def call_text(cls, name: str, arguments: dict[str, Any] | str) -> str:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return f'{{"name": {json.dumps(name)}, "parameters": {args}}}'

    @classmethod
    def _call_rule(cls) -> str:
        return "call: fn"


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}
PARSER_CHOICES = ("auto", *PARSERS, "none")


def parser_for(choice: str, chat_template: str | None) -> type[ToolParser] | None:
    """The format of ``--tool-call-parser`` (``auto``: from the chat template; ``none``: None)."""
    if choice not in PARSER_CHOICES:
        raise ValueError(f"tool_call_parser must be one of {PARSER_CHOICES}, got {choice!r}")
    if choice == "none":
        return None
    if choice != "auto":
        return PARSERS[choice]
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesParser
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and "ipython" in template):
        return Llama3JsonParser
    return HermesParser  # the format of jbatch's default tools prompt
