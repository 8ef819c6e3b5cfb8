"""SamplingParams: validation (ValueError naming the field and value) and normalisation."""

import dataclasses

import pytest

from jbatch.sampling_params import SamplingParams


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
