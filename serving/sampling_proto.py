"""``jbatch.v1.SamplingParams`` (proto) <-> :class:`jbatch.SamplingParams`, field by field.

The mapping iterates over the fields the ``grpc`` surface exposes (``jbatch.sampling_surfaces``):
an unset proto field (``HasField`` false, or an empty list) takes the Python default; the
``structured`` oneof (and ``whitespace_flexible``) maps to ``SamplingParams.structured``. The
``.proto`` is written by hand, so importing this module checks that it matches the dataclass
(:func:`proto_mismatches`) and raises naming every field that does not.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from jbatch.sampling_params import SamplingParams
from jbatch.sampling_surfaces import reject_hidden_values, surface_fields
from jbatch.structured_output import StructuredOutput
from serving.proto.jbatch.v1 import generation_pb2 as pb

_FD = FieldDescriptor
_KIND_OF_PROTO_TYPE: dict[int, type] = {
    **dict.fromkeys((_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT), float),
    **dict.fromkeys((_FD.TYPE_INT32, _FD.TYPE_INT64, _FD.TYPE_UINT32, _FD.TYPE_UINT64), int),
    **dict.fromkeys((_FD.TYPE_SINT32, _FD.TYPE_SINT64), int),
    _FD.TYPE_BOOL: bool,
    _FD.TYPE_STRING: str,
}
_PROTO_TYPE_NAMES = {getattr(_FD, n): n[5:].lower() for n in dir(_FD) if n.startswith("TYPE_")}
# SamplingParams.structured: the proto's `structured` oneof (field -> StructuredOutput kind)
# plus one option beside it.
STRUCTURED_ONEOF = "structured"
_STRUCTURED_KINDS = {
    "json_schema": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
    "grammar": "grammar",
}  # fmt: skip
_STRUCTURED_OPTIONS = ("whitespace_flexible",)


def proto_mismatches(
    descriptor: Descriptor = pb.SamplingParams.DESCRIPTOR, params_cls: type = SamplingParams
) -> list[str]:
    """Every way the proto message and the ``grpc`` fields of ``params_cls`` disagree."""
    problems = []
    exposed = surface_fields("grpc", params_cls)
    for field in exposed:
        where = f"grpc: {params_cls.__name__}.{field.name}"
        fd = descriptor.fields_by_name.get(field.surface_name)
        if fd is None:
            problems.append(
                f"{where} has no field {field.surface_name!r} in {descriptor.full_name}: add one "
                "(a new field number, then scripts/gen_proto.sh) or hide the field from 'grpc' "
                "in jbatch/sampling_surfaces.py SURFACE_RULES with the reason"
            )
            continue
        proto_type = _PROTO_TYPE_NAMES.get(fd.type, str(fd.type))
        if _KIND_OF_PROTO_TYPE.get(fd.type) is not field.shape.kind:
            kind = field.shape.kind.__name__
            problems.append(f"{where} holds {kind} but {fd.full_name} holds {proto_type}")
        if fd.is_repeated != field.shape.repeated:
            shape = {True: "repeated", False: "a single value"}
            problems.append(
                f"{where} is {shape[field.shape.repeated]} but {fd.full_name} is "
                f"{shape[fd.is_repeated]}"
            )
        elif not fd.is_repeated and not fd.has_presence:
            problems.append(f"{fd.full_name} must be `optional`: unset means the Python default")
    mapped = {field.surface_name for field in exposed} | set(_STRUCTURED_OPTIONS)
    oneof = descriptor.oneofs_by_name.get(STRUCTURED_ONEOF)
    if oneof is None or {f.name for f in oneof.fields} != set(_STRUCTURED_KINDS):
        problems.append(f"grpc: {descriptor.full_name} needs the oneof {STRUCTURED_ONEOF} of "
                        f"{sorted(_STRUCTURED_KINDS)} (SamplingParams.structured)")  # fmt: skip
    else:
        mapped |= set(_STRUCTURED_KINDS)
    for name in descriptor.fields_by_name:
        if name not in mapped:
            problems.append(
                f"grpc: {descriptor.full_name}.{name} maps to no {params_cls.__name__} field the "
                "grpc surface exposes: the server would ignore it"
            )
    return problems


_MISMATCHES = proto_mismatches()
if _MISMATCHES:
    raise TypeError("the proto does not match SamplingParams:\n  " + "\n  ".join(_MISMATCHES))
_FIELDS = surface_fields("grpc")


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset fields take the Python defaults; raises ValueError naming a bad field."""
    kwargs = {}
    for field in _FIELDS:
        if field.shape.repeated:
            values = list(getattr(msg, field.surface_name))
            kwargs[field.name] = values if values else field.default
        elif msg.HasField(field.surface_name):
            kwargs[field.name] = getattr(msg, field.surface_name)
        else:
            kwargs[field.name] = field.default
    return SamplingParams(**kwargs, structured=_structured_from_proto(msg))


def _structured_from_proto(msg: pb.SamplingParams) -> StructuredOutput | None:
    which = msg.WhichOneof(STRUCTURED_ONEOF)
    if which is None:
        if msg.HasField("whitespace_flexible"):
            raise ValueError("whitespace_flexible is set without a structured output kind")
        return None
    value = getattr(msg, which)
    value = list(value.choices) if which == "choice" else value
    options = {name: getattr(msg, name) for name in _STRUCTURED_OPTIONS if msg.HasField(name)}
    return StructuredOutput(**{_STRUCTURED_KINDS[which]: value}, **options)


def _structured_to_proto(spec: StructuredOutput, msg: pb.SamplingParams) -> None:
    kind = spec.kind
    proto_name = next(p for p, k in _STRUCTURED_KINDS.items() if k == kind)
    if kind == "choice":
        msg.choice.choices.extend(spec.choice)
    else:
        setattr(msg, proto_name, getattr(spec, kind))
    for name in _STRUCTURED_OPTIONS:
        setattr(msg, name, getattr(spec, name))


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The inverse of :func:`sampling_params_from_proto` (clients use it). Raises ValueError
    for a field gRPC cannot carry (``n``) when it is not at its default."""
    reject_hidden_values(params.replace(structured=None), "grpc")  # structured: the oneof
    msg = pb.SamplingParams()
    for field in _FIELDS:
        value = getattr(params, field.name)
        if field.shape.repeated:
            getattr(msg, field.surface_name).extend(value)
        elif value is not None:
            setattr(msg, field.surface_name, value)
    if params.structured is not None:
        _structured_to_proto(params.structured, msg)
    return msg
