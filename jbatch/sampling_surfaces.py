"""Which SamplingParams fields each front end exposes, and how: one table of exceptions.

Every field of :class:`SamplingParams` appears on every surface under its own name, with its
own default and its ``help`` metadata, unless :data:`SURFACE_RULES` says otherwise (always with
the reason). The surfaces are built from :func:`surface_fields`:

- ``cli``: the sampling flags of ``jbatch generate`` and ``jbatch client`` (``jbatch/cli.py``);
- ``grpc``: the ``jbatch.v1.SamplingParams`` proto message (``serving/sampling_proto.py``; the
  ``.proto`` is written by hand, and that module refuses to load when it lacks a field);
- ``http``: the OpenAI request models (``serving/openai_protocol.py``).

Adding a field to SamplingParams is therefore: the field (``_field(default, help)``) and its
check in ``__post_init__``, plus a proto field, or a rule here that hides it from a surface.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any

from jbatch.sampling_params import SamplingParams

SURFACES = ("cli", "grpc", "http")
SCALAR_KINDS = (bool, int, float, str)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one surface departs from a field's name, default or presence; ``reason`` says why."""

    reason: str
    exposed: bool = True
    name: str | None = None  # the surface's name for the field (None: the field's name)
    default: Any = UNSET  # the surface's default (UNSET: the field's default)


def hidden(reason: str) -> Rule:
    """The surface does not offer the field at all."""
    return Rule(reason, exposed=False)


SURFACE_RULES: dict[str, dict[str, Rule]] = {
    "cli": {
        "n": hidden("the CLI prints one completion per prompt (the servers and LLM take n)"),
        "logprobs": hidden("the CLI prints text, not log-probabilities"),
        "prompt_logprobs": hidden("the CLI prints text, not log-probabilities"),
        "max_tokens": Rule("a longer default than 16 to see what a model writes", default=64),
        "temperature": Rule("greedy by default: one command, one output", default=0.0),
        "structured": hidden("a JSON Schema or grammar does not fit a flag; use the Python API"),
        "speculative": hidden(
            "the engine flag --speculative (EngineConfig) turns speculation on for the whole "
            "run; the per-request opt-out is for servers and the Python API"
        ),
    },
    "grpc": {
        "n": hidden(
            "GenerateRequest.n (field 11) carries it: the SamplingParams message reserved field "
            "1 and the name 'n' when the server ran one sequence per request (proto rules: a "
            "reserved name is never reused)"
        ),
        "structured": hidden("the `structured` oneof of the proto (serving/sampling_proto.py)"),
    },
    "http": {
        "logprobs": hidden(
            "declared by the request models in OpenAI's forms: completions take an int, chat "
            "`logprobs: true` with `top_logprobs`"
        ),
        "structured": Rule(
            "OpenAI's `response_format`, or jbatch's `structured_outputs` (openai_protocol.py)",
            exposed=False,
            name="structured_outputs",
        ),
    },
}


@dataclasses.dataclass(frozen=True)
class FieldShape:
    """What a field holds, read off its annotation."""

    kind: type  # bool, int, float or str: the value, or each item of a list
    repeated: bool  # a list of ``kind`` values
    accepts_single: bool  # a repeated field that also takes one bare value (``stop="###"``)
    optional: bool  # None is allowed


@dataclasses.dataclass(frozen=True)
class SurfaceField:
    """One SamplingParams field as one surface offers it."""

    name: str  # the SamplingParams field
    surface_name: str  # its name on the surface (flag, proto field, JSON key)
    default: Any  # used when a request leaves it unset
    help: str
    shape: FieldShape


def field_shape(params_cls: type, name: str) -> FieldShape:
    """The shape of ``params_cls.name``; TypeError for annotations the surfaces cannot map."""
    hint = typing.get_type_hints(params_cls)[name]
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    args = typing.get_args(hint) if is_union else (hint,)
    optional = type(None) in args
    scalars = [a for a in args if a in SCALAR_KINDS]
    lists = [
        typing.get_args(a)[0]
        for a in args
        if typing.get_origin(a) in (collections.abc.Sequence, list) and len(typing.get_args(a)) == 1
    ]
    if len(scalars) + len(lists) + optional == len(args):
        if len(scalars) == 1 and not lists:
            return FieldShape(scalars[0], False, False, optional)
        if len(lists) == 1 and lists[0] in SCALAR_KINDS and scalars in ([], lists):
            return FieldShape(lists[0], True, bool(scalars), optional)
    raise TypeError(
        f"{params_cls.__name__}.{name}: the front ends cannot map the annotation {hint!r}; use "
        f"bool, int, float or str, a Sequence of one of them, optionally with | None"
    )


def _rules(surface: str, params_cls: type) -> dict[str, Rule]:
    if surface not in SURFACE_RULES:
        raise ValueError(f"unknown surface {surface!r}; surfaces: {', '.join(SURFACES)}")
    rules = SURFACE_RULES[surface]
    names = {f.name for f in dataclasses.fields(params_cls)}
    stale = sorted(set(rules) - names)
    if stale:
        raise ValueError(
            f"SURFACE_RULES[{surface!r}] names {stale}, not fields of {params_cls.__name__}"
        )
    return rules


def _surface_field(params_cls: type, f: dataclasses.Field, rule: Rule | None) -> SurfaceField:
    where = f"{params_cls.__name__}.{f.name}"
    if "help" not in f.metadata:
        raise TypeError(f"{where} has no help metadata: declare it with _field(default, help)")
    if f.default is dataclasses.MISSING:
        raise TypeError(f"{where} needs a plain default: an unset request field takes it")
    rule = rule or Rule("")
    return SurfaceField(
        name=f.name,
        surface_name=rule.name or f.name,
        default=f.default if rule.default is UNSET else rule.default,
        help=f.metadata["help"],
        shape=field_shape(params_cls, f.name),
    )


def surface_fields(surface: str, params_cls: type = SamplingParams) -> list[SurfaceField]:
    """The fields ``surface`` exposes, in declaration order, with their surface names/defaults."""
    rules = _rules(surface, params_cls)
    exposed = [
        _surface_field(params_cls, f, rules.get(f.name))
        for f in dataclasses.fields(params_cls)
        if f.name not in rules or rules[f.name].exposed
    ]
    names = [f.surface_name for f in exposed]
    if len(set(names)) != len(names):
        raise ValueError(f"SURFACE_RULES[{surface!r}] gives two fields one name: {names}")
    return exposed


def hidden_fields(surface: str, params_cls: type = SamplingParams) -> dict[str, str]:
    """Field name -> reason, for the fields ``surface`` does not expose."""
    return {k: r.reason for k, r in _rules(surface, params_cls).items() if not r.exposed}


def reject_hidden_values(params: SamplingParams, surface: str) -> None:
    """ValueError naming the first field ``surface`` cannot carry that is not at its default."""
    defaults = type(params)()
    for name, reason in hidden_fields(surface, type(params)).items():
        value = getattr(params, name)
        if value != getattr(defaults, name):
            raise ValueError(f"{name}={value!r} cannot be sent over {surface}: {reason}")
