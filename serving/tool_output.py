"""A chat completion's output as OpenAI's ``message.content`` and ``message.tool_calls``.

:class:`ToolCalling` is what a request with tools carries (``Translated.tools``): the output's
format (a :mod:`serving.tool_parsers` class) and how many calls it may make. Its
:class:`ToolStream` turns the completion's :class:`Delta` s, one by one, into the message
fields of each streamed chunk (``content`` for text outside calls, ``tool_calls`` entries
``{index, id, type, function: {name, arguments}}``, a call arriving whole once its end is
known); :meth:`ToolCalling.whole` runs the same stream over a whole completion, so a streamed
response assembles to the non-streamed one (the ids aside: ``call_<random>`` each).

Around calls, whitespace is not content: the blanks between a call and the text or call next
to it are dropped (``"Let me look.\\n<tool_call>...</tool_call>\\n"`` has content ``"Let me
look."``); content that is all blank, or none, is null. A completion that made a call and
stopped has ``finish_reason: "tool_calls"`` (one cut off by ``max_tokens`` keeps ``length``).
Calls past ``max_calls`` (``parallel_tool_calls: false`` under ``auto``: 1) are dropped.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from serving.request_stream import Delta
from serving.tool_parsers import ParsedCall, ToolParser


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """How one request's output is parsed (see the module doc)."""

    parser: type[ToolParser]
    max_calls: int | None = None  # None: any number

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def whole(self, delta: Delta) -> tuple[dict[str, Any], Delta]:
        """The ``message`` fields of a whole completion, and its delta (finish reason set)."""
        fields, delta = self.stream().feed(delta)
        calls = [{k: v for k, v in c.items() if k != "index"} for c in fields.get("tool_calls", ())]
        message: dict[str, Any] = {"content": fields.get("content")}
        if calls:
            message["tool_calls"] = calls
        return message, delta


class ToolStream:
    """The message fields of each chunk of one streamed completion."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.parser = calling.parser()
        self.calls = 0  # calls handed out so far
        self._blank = ""  # trailing whitespace held back: content only if text follows
        self._after_call = False  # the last piece was a call: leading whitespace is dropped

    def feed(self, delta: Delta) -> tuple[dict[str, Any], Delta]:
        """The chunk's message fields (``content`` and / or ``tool_calls``, either absent when
        there is nothing of it yet) and ``delta`` with ``tool_calls`` as its finish reason when
        the completion ends by calling."""
        pieces = self.parser.feed(delta.text)
        if delta.finished:
            pieces += self.parser.finish()
        text, calls = [], []
        for piece in pieces:
            if isinstance(piece, str):
                text.append(self._text(piece))
            else:
                calls.extend(self._call(piece))
        if delta.finished and not self._after_call:
            text.append(self._blank)
        fields: dict[str, Any] = {}
        if "".join(text):
            fields["content"] = "".join(text)
        if calls:
            fields["tool_calls"] = calls
        if delta.finished and self.calls and delta.finish_reason == "stop":
            delta = dataclasses.replace(delta, finish_reason="tool_calls")
        return fields, delta

    def _text(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._blank += text
            return ""
        out, self._blank = self._blank + body, text[len(body) :]
        return out

    def _call(self, call: ParsedCall) -> list[dict[str, Any]]:
        self._blank, self._after_call = "", True
        limit = self.calling.max_calls
        if limit is not None and self.calls >= limit:
            return []
        self.calls += 1
        function = {"name": call.name, "arguments": call.arguments}
        entry = {"index": self.calls - 1, "id": call_id(), "type": "function"}
        return [{**entry, "function": function}]
