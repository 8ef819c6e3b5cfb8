"""OpenAI's ``response_format`` and jbatch's ``structured_outputs`` -> a StructuredOutput.

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}``. The schema is always enforced exactly (llguidance compiles it into a
  grammar), so ``strict: false`` is honoured as ``true`` is: the output always validates.
- ``structured_outputs`` (jbatch's extra, vLLM's name): one of ``json`` (a schema),
  ``json_object``, ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or GBNF), and
  optionally ``whitespace_flexible``.

At most one of the two per request. Every problem is a ValueError naming the field, which the
servers turn into a 400.
"""

from __future__ import annotations

from typing import Any

from jbatch.structured_output import StructuredOutput

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_from_request(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutput | None:
    """The request's output constraint (None: free text)."""
    if response_format is not None and structured_outputs is not None:
        raise ValueError("response_format and structured_outputs: give at most one")
    if structured_outputs is not None:
        return StructuredOutput.from_dict(structured_outputs, "structured_outputs")
    if response_format is None:
        return None
    return _from_response_format(response_format)


def _from_response_format(fmt: Any) -> StructuredOutput | None:
    if not isinstance(fmt, dict):
        raise ValueError(f"response_format must be an object, got {fmt!r:.60}")
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"response_format.type must be one of {RESPONSE_FORMATS}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError(
            f"response_format.json_schema must be an object with a 'schema', got {spec!r:.60}"
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError(
            f"response_format.json_schema.schema must be a JSON Schema object, got {schema!r:.60}"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"response_format.json_schema.strict must be a bool, got {strict!r}")
    try:
        return StructuredOutput(json=schema)
    except ValueError as e:
        raise ValueError(f"response_format.json_schema.schema: {e}") from None
