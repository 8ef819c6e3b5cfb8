"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked, and what
they mean for the prompt, the constraint and the output.

- ``tools``: OpenAI function tools, ``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``; ``name`` matches ``[A-Za-z0-9_-]{1,64}`` and is unique,
  ``parameters`` is a JSON Schema of an object (absent: no arguments) that llguidance compiles.
  The template gets the list as sent (HF's ``tools`` argument).
- ``tool_choice``: ``"auto"`` (the default with tools: the model may call; its output is
  parsed, not constrained), ``"none"`` (the default without: tools stay in the prompt, so it is
  the same prompt as the turns that may call and the prefix cache reuses it, but the output is
  plain content, never parsed), ``"required"`` (one or more calls, forced) or ``{"type":
  "function", "function": {"name"}}`` (exactly one call to that function, forced). Forcing is a
  structured-output grammar in the parser's format, so the arguments always parse and match
  the function's schema.
- ``parallel_tool_calls`` (default true): false makes ``required`` force exactly one call and
  ``auto`` keep only the first.

Every problem is a ValueError naming the field (a 400).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

import llguidance

from jbatch.structured_output import StructuredOutput
from serving.tool_output import ToolCalling
from serving.tool_parsers import ToolParser

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as sent (checked): what the template renders
    schemas: dict[str, dict[str, Any]]  # function name -> its arguments' schema (an object)
    choice: str  # one of CHOICES, or "function" (``forced`` names it)
    forced: str | None
    parallel: bool
    parser: type[ToolParser] | None  # None: --tool-call-parser none

    @classmethod
    def from_fields(
        cls, tools: Any, tool_choice: Any, parallel: Any, parser: type[ToolParser] | None
    ) -> ToolRequest | None:
        """None without tools (and then only ``tool_choice`` ``none`` or null is valid)."""
        if parallel is not None and not isinstance(parallel, bool):
            raise ValueError(f"parallel_tool_calls must be a bool, got {parallel!r:.60}")
        if tools is not None and not isinstance(tools, list):
            raise ValueError(f"tools must be a list of tools, got {tools!r:.60}")
        if not tools:
            if tool_choice not in (None, "none"):
                raise ValueError(f"tool_choice {tool_choice!r:.60} needs tools; none were given")
            return None
        schemas: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools):
            name, schema = _check_tool(i, tool)
            if name in schemas:
                raise ValueError(f"tools[{i}].function.name: {name!r} is given twice")
            schemas[name] = schema
        choice, forced = _check_choice(tool_choice, schemas)
        if choice in ("required", "function") and parser is None:
            raise ValueError(
                f"tool_choice {tool_choice!r:.60} needs a tool-call parser to force the call; "
                "this server runs with --tool-call-parser none"
            )
        return cls(tools, schemas, choice, forced, parallel is not False, parser)

    def constrain(self, structured: StructuredOutput | None) -> StructuredOutput | None:
        """The request's output constraint: the forced calls' grammar, or ``structured``."""
        if self.choice not in ("required", "function"):
            return structured
        if structured is not None:
            raise ValueError(
                f"tool_choice {self.choice!r} forces a tool call; it cannot be combined "
                "with response_format / structured_outputs"
            )
        names = [self.forced] if self.forced else list(self.schemas)
        parallel = self.parallel and self.forced is None
        grammar = self.parser.grammar([(n, self.schemas[n]) for n in names], parallel)
        return StructuredOutput(grammar=grammar)

    def output(self) -> ToolCalling | None:
        """How the output is parsed (None: plain content)."""
        if self.choice == "none" or self.parser is None:
            return None
        return ToolCalling(self.parser, None if self.parallel else 1)


def _check_tool(i: int, tool: Any) -> tuple[str, dict[str, Any]]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f"{where}: only function tools are supported, got {tool!r:.60}")
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        raise ValueError(f"{where}: unknown key(s) {extra}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object, got {function!r:.60}")
    extra = sorted(set(function) - FUNCTION_KEYS)
    if extra:
        raise ValueError(f"{where}.function: unknown key(s) {extra}; keys: {sorted(FUNCTION_KEYS)}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.function.strict must be a bool, got {strict!r}")
    return name, _arguments_schema(f"{where}.function.parameters", function.get("parameters"))


def _arguments_schema(where: str, schema: Any) -> dict[str, Any]:
    if schema is None or schema == {}:
        return NO_ARGUMENTS
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object, got {schema!r:.60}")
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f"{where}.type must be 'object' (arguments are an object), got {kind!r}")
    schema = {**schema, "type": "object"}
    error = _schema_error(json.dumps(schema, sort_keys=True))
    if error:
        raise ValueError(f"{where}: {error}")
    return schema


@functools.lru_cache(maxsize=256)
def _schema_error(schema_text: str) -> str | None:
    """llguidance's objection to a schema (None: it compiles)."""
    grammar = llguidance.grammar_from("lark", f"start: %json {schema_text}\n")
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if not is_error:
        return None
    return (messages[0] if messages else "invalid JSON Schema").split("\n")[0]


def _check_choice(choice: Any, schemas: dict[str, Any]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(f"tool_choice must be one of {CHOICES} or a function, got {choice!r}")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not function:
        raise ValueError(
            f"tool_choice must be one of {CHOICES} or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r:.60}'
        )
    name = function.get("name") if isinstance(function, dict) else None
    if name not in schemas:
        listed = ", ".join(schemas)
        raise ValueError(f"tool_choice.function.name: {name!r:.60} is not a tool ({listed})")
    return "function", name
