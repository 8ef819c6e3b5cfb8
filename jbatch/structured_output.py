"""StructuredOutput: what shape a request's output must take (JSON Schema, regex, choice, grammar).

A plain, hashable value that ``SamplingParams(structured=...)`` carries; the engine compiles it
with llguidance (``jbatch/engine/grammar.py``) into a matcher that masks every sampled token.
Exactly one kind is set:

- ``json``: a JSON Schema (a dict or its JSON text); ``json_object=True``: any JSON object;
- ``regex``: the whole output matches this regular expression (Rust ``regex`` syntax);
- ``choice``: the output is exactly one of these strings;
- ``grammar``: a context-free grammar, Lark syntax (llguidance's dialect) or GBNF (llama.cpp).

JSON output is compact by default (``,`` and ``:`` separators, no whitespace between tokens), so
a model cannot wander into unbounded runs of spaces and newlines and a valid object fits a
modest ``max_tokens``; ``whitespace_flexible=True`` allows JSON's free whitespace.
"""

from __future__ import annotations

import dataclasses
import json as _json
from collections.abc import Sequence
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """One output constraint (see the module doc); ValueError naming the field when invalid."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False  # JSON only: allow free whitespace between tokens

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured output needs exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured.json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.whitespace_flexible, bool):
            raise ValueError(
                f"structured.whitespace_flexible must be a bool, got {self.whitespace_flexible!r}"
            )
        if self.json is not None:
            set_("json", _schema_text(self.json))  # canonical text: hashable, one cache key
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice:
                raise ValueError(f"structured.choice must be a non-empty list, got {choice!r}")
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError(
                    f"structured.choice must hold non-empty strings only, got {list(choice)!r}"
                )
            set_("choice", tuple(choice))

    @property
    def kind(self) -> str:
        """The one kind that is set (one of ``KINDS``)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema as a dict (``json_object``: any object), None for other kinds."""
        if self.json is not None:
            return _json.loads(self.json)
        return {"type": "object"} if self.json_object else None

    @classmethod
    def from_dict(cls, spec: Any, field: str = "structured_outputs") -> StructuredOutput:
        """From a JSON body's object, e.g. ``{"regex": "[0-9]+"}``; ValueError names ``field``."""
        if not isinstance(spec, dict):
            raise ValueError(f"{field} must be an object, got {spec!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - names)
        if unknown:
            raise ValueError(f"{field}: unknown key(s) {unknown}; keys: {sorted(names)}")
        try:
            return cls(**spec)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except _json.JSONDecodeError as e:
            raise ValueError(f"structured.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured.json must be a JSON Schema object, got {schema!r}")
    try:
        return _json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured.json cannot be serialized as JSON: {e}") from None
