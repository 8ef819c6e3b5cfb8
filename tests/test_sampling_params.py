"""SamplingParams: validation (ValueError naming the field and value), normalisation, and the
CLI / gRPC / HTTP surfaces derived from its fields (jbatch.sampling_surfaces)."""

import argparse
import dataclasses

import pytest

from jbatch.cli import _add_sampling_flags, _build_parser, _sampling_params
from jbatch.cli import main as cli_main
from jbatch.sampling_params import SamplingParams, _field
from jbatch.sampling_surfaces import (
    SURFACE_RULES,
    SURFACES,
    FieldShape,
    field_shape,
    hidden,
    hidden_fields,
    surface_fields,
)
from serving.context import ServingContext
from serving.http_server import build_app
from serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    sampling_request_model,
)
from serving.proto.jbatch.v1 import generation_pb2 as pb
from serving.sampling_proto import (
    proto_mismatches,
    sampling_params_from_proto,
    sampling_params_to_proto,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.0),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", None),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_k", False),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("seed", -1),
        ("seed", 2**32),
        ("seed", 1.0),
        ("seed", "7"),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("min_tokens", 1.0),
        ("stop", ""),
        ("stop", ["a", ""]),
        ("stop", ["a", 3]),
        ("stop", 5),
        ("stop_token_ids", [1, -1]),
        ("stop_token_ids", [1, 2.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 7),
        ("ignore_eos", 1),
        ("include_stop_str_in_output", "yes"),
        ("skip_special_tokens", None),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
    ],
)
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_valid_edges():
    SamplingParams(temperature=0, top_p=1, min_p=1, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(seed=0)
    SamplingParams(seed=2**32 - 1, logprobs=0, n=4, max_tokens=None)
    SamplingParams(logprobs=20, top_k=1, top_p=1e-6)


def test_normalisation():
    p = SamplingParams(temperature=1, top_p=1, top_k=-1, repetition_penalty=2)
    assert p.top_k == 0
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.repetition_penalty, float)
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[2, 0]).stop_token_ids == (2, 0)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()


def test_greedy_frozen_and_replace():
    p = SamplingParams(temperature=0.0, stop=["x"])
    assert p.is_greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    q = p.replace(temperature=0.5)
    assert not q.is_greedy and q.stop == ("x",) and p.temperature == 0.0
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=2.0)
    assert SamplingParams(repetition_penalty=1.2).uses_penalties
    assert not SamplingParams().uses_penalties
    assert hash(p) == hash(SamplingParams(temperature=0.0, stop=("x",)))


# ---- one source of truth: the CLI, gRPC and HTTP surfaces derive from the dataclass fields ------
@dataclasses.dataclass(frozen=True)
class Extended(SamplingParams):
    """SamplingParams with a field added: every surface must pick it up or name what it lacks."""

    typical_p: float = _field(1.0, "locally typical sampling mass")


def _cli_parser(params_cls=SamplingParams) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    _add_sampling_flags(parser, params_cls)
    return parser


def test_every_field_has_help_and_a_shape_every_surface_maps():
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    for surface in SURFACES:
        exposed = {f.name for f in surface_fields(surface)}
        assert exposed | set(hidden_fields(surface)) == set(names), surface
        assert all(reason for reason in hidden_fields(surface).values())
    assert set(SURFACE_RULES) == set(SURFACES)
    assert field_shape(SamplingParams, "stop") == FieldShape(str, True, True, True)
    assert field_shape(SamplingParams, "stop_token_ids") == FieldShape(int, True, False, True)
    assert field_shape(SamplingParams, "seed") == FieldShape(int, False, False, True)
    assert field_shape(SamplingParams, "ignore_eos") == FieldShape(bool, False, False, False)


def test_bad_field_definitions_fail_naming_the_field(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class NoHelp(SamplingParams):
        typical_p: float = 1.0

    @dataclasses.dataclass(frozen=True)
    class Unmappable(SamplingParams):
        phase: complex = _field(0j, "no surface has complex numbers")

    with pytest.raises(TypeError, match=r"NoHelp\.typical_p has no help"):
        surface_fields("cli", NoHelp)
    with pytest.raises(TypeError, match=r"Unmappable\.phase"):
        surface_fields("http", Unmappable)
    monkeypatch.setitem(SURFACE_RULES["grpc"], "typo_p", hidden("stale"))
    with pytest.raises(ValueError, match="typo_p"):
        surface_fields("grpc")
    with pytest.raises(ValueError, match="unknown surface"):
        surface_fields("smoke-signals")


def test_cli_flags_follow_the_fields():
    parser = _cli_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for field in surface_fields("cli"):
        assert "--" + field.name.replace("_", "-") in flags, field.name
    for name in hidden_fields("cli"):
        assert "--" + name.replace("_", "-") not in flags, name
    defaults = _sampling_params(parser.parse_args([]))
    assert defaults == SamplingParams(max_tokens=64, temperature=0.0)  # the CLI's own defaults
    argv = "--max-tokens 5 --stop a --stop b --stop-token-ids 7 --stop-token-ids 9 --seed 3 "
    argv += "--ignore-eos --no-skip-special-tokens --top-k -1 --min-p 0.5"
    got = _sampling_params(parser.parse_args(argv.split()))
    assert got == SamplingParams(
        max_tokens=5, temperature=0.0, stop=["a", "b"], stop_token_ids=[7, 9], seed=3,
        ignore_eos=True, skip_special_tokens=False, top_k=0, min_p=0.5,
    )  # fmt: skip
    extended = _cli_parser(Extended)
    assert _sampling_params(extended.parse_args(["--typical-p", "0.3"]), Extended).typical_p == 0.3


@pytest.mark.parametrize("command", [["generate"], ["client", "--target", "127.0.0.1:9"]])
def test_cli_bad_value_names_the_field(capsys, command):
    parser = _build_parser()
    for sub in parser._subparsers._group_actions[0].choices.values():
        dests = [a.dest for a in sub._actions if a.dest != "help"]
        assert len(dests) == len(set(dests)), "two flags share a destination"
    assert cli_main([*command, "--top-p", "2", "x"]) == 2  # before any model load / connection
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


def test_proto_matches_the_fields(monkeypatch):
    assert proto_mismatches() == []

    @dataclasses.dataclass(frozen=True)
    class Retyped(SamplingParams):
        top_k: float = _field(0.0, "top-k as a float")
        stop_token_ids: int = _field(0, "one id")

    problems = proto_mismatches(params_cls=Retyped)
    top_k, ids = "jbatch.v1.SamplingParams.top_k", "jbatch.v1.SamplingParams.stop_token_ids"
    assert f"grpc: Retyped.top_k holds float but {top_k} holds int32" in problems
    assert f"grpc: Retyped.stop_token_ids is a single value but {ids} is repeated" in problems
    (missing,) = proto_mismatches(params_cls=Extended)
    assert "grpc: Extended.typical_p has no field 'typical_p' in jbatch.v1.Sampl" in missing
    with monkeypatch.context() as m:
        m.setitem(SURFACE_RULES["grpc"], "typical_p", hidden("not in v1"))
        assert proto_mismatches(params_cls=Extended) == []
    monkeypatch.setitem(SURFACE_RULES["grpc"], "seed", hidden("test"))
    assert any("SamplingParams.seed maps to no" in p for p in proto_mismatches())


def test_proto_mapping_round_trip_and_defaults():
    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()
    params = SamplingParams(
        temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, repetition_penalty=1.2,
        presence_penalty=0.3, frequency_penalty=-0.4, seed=11, max_tokens=33, min_tokens=2,
        stop=["x", "yz"], stop_token_ids=[4], ignore_eos=True, include_stop_str_in_output=True,
        skip_special_tokens=False, logprobs=2, prompt_logprobs=0, speculative=False,
    )  # fmt: skip
    assert all(  # every exposed field differs from its default, so the round trip tests it
        getattr(params, f.name) != getattr(SamplingParams(), f.name) for f in surface_fields("grpc")
    )
    msg = sampling_params_to_proto(params)
    assert sampling_params_from_proto(msg) == params
    assert sampling_params_from_proto(pb.SamplingParams(max_tokens=5)).temperature == 1.0
    with pytest.raises(ValueError, match="min_p"):
        sampling_params_from_proto(pb.SamplingParams(min_p=2.0))
    for hidden_value in (dict(n=2),):
        with pytest.raises(ValueError, match=f"{next(iter(hidden_value))}=.*grpc"):
            sampling_params_to_proto(SamplingParams(**hidden_value))


def test_http_models_follow_the_fields():
    for field in surface_fields("http"):
        assert field.name in CompletionRequest.model_fields, field.name
        assert field.name in ChatCompletionRequest.model_fields, field.name
    for name in hidden_fields("http"):  # declared (and checked) by the model, never ignored
        declared = SURFACE_RULES["http"][name].name or name
        assert declared in CompletionRequest.model_fields, name
    req = CompletionRequest(prompt="hi", stop="###", stop_token_ids=[3], temperature=0, seed=None)
    assert req.sampling_params() == SamplingParams(stop="###", stop_token_ids=[3], temperature=0)
    model = sampling_request_model(Extended)
    got = model(typical_p=0.25, max_tokens=4).sampling_params()
    assert isinstance(got, Extended) and (got.typical_p, got.max_tokens) == (0.25, 4)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "min_tokens": "many"}, "min_tokens"),
        ({"prompt": "hi", "stop_token_ids": [1, "x"]}, "stop_token_ids"),
        ({"prompt": "hi", "n": 0}, "n must be >= 1"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ],
)
def test_http_bad_value_is_400_naming_the_field(body, needle):
    from fastapi.testclient import TestClient

    with TestClient(build_app(ServingContext("m"))) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
