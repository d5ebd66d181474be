from __future__ import annotations

import math

import msgspec
import pytest

from asyncinfer.errors import InvalidParameterError
from asyncinfer.sampling_params import SamplingParams


def test_defaults_are_greedy_and_valid():
    p = SamplingParams()
    assert p.max_tokens == 128
    assert p.temperature == 0.0 and p.greedy
    assert p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
    assert p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.seed is None and p.stop is None and p.stop_token_ids is None
    assert p.ignore_eos is False and p.logprobs is None
    assert p.include_stop_str_in_output is False and p.skip_special_tokens is True
    assert p.min_tokens == 0
    assert p.stop_strings == ()
    assert not p.has_penalties


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", "5"),
        ("max_tokens", True),
        ("max_tokens", 5.0),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "1"),
        ("temperature", True),
        ("temperature", 10**400),
        ("temperature", 1e39),  # finite in float64, overflows float32 sampling
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", False),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", None),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("seed", True),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", ["ok", 3]),
        ("stop", 3),
        ("stop", {"a"}),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 5),
        ("ignore_eos", 1),
        ("include_stop_str_in_output", "yes"),
        ("skip_special_tokens", None),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("min_tokens", -1),
        ("min_tokens", 129),  # > default max_tokens
        ("n", 0),
        ("n", 65),
        ("n", 2.0),
        ("n", True),
        ("n", None),
    ],
)
def test_rejects_bad_values(name, value):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{name: value})
    err = info.value
    assert err.parameter == name
    assert err.value is value  # the offending value itself, not a converted copy
    assert str(err) == f"{name}={value!r} is invalid: allowed {err.allowed}"  # names parameter and value
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 2},
        {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
        {"top_k": -1},
        {"top_k": 1},
        {"top_p": 1e-9},
        {"min_p": 1.0},
        {"repetition_penalty": 0.5},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop": "x"},
        {"stop": ["a", "bc"]},
        {"stop": []},
        {"stop_token_ids": [0, 5]},
        {"stop_token_ids": []},
        {"logprobs": 0},
        {"logprobs": 20},
        {"min_tokens": 10, "max_tokens": 10},
        {"ignore_eos": True, "include_stop_str_in_output": True, "skip_special_tokens": False},
        {"n": 1},
        {"n": 64},
    ],
)
def test_accepts_good_values(kw):
    p = SamplingParams(**kw)
    assert {name: getattr(p, name) for name in kw} == kw  # kept as given, nothing rewritten


def test_for_sample_gives_one_sample_with_its_own_seed():
    p = SamplingParams(n=3, seed=10, temperature=0.7)
    assert [q.seed for q in (p.for_sample(i) for i in range(3))] == [10, 11, 12]
    assert all(p.for_sample(i).n == 1 and p.for_sample(i).temperature == 0.7 for i in range(3))
    assert SamplingParams(n=2, seed=2**63 - 1).for_sample(1).seed == 0  # wraps within the seed range
    assert SamplingParams(n=2).for_sample(1).seed is None
    single = SamplingParams(seed=4)
    assert single.for_sample(0) is single
    assert SamplingParams().n == 1


def test_min_tokens_relative_to_max_tokens():
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.parameter == "min_tokens"
    assert "4" in info.value.allowed


def test_stop_strings_normalised():
    assert SamplingParams(stop="ab").stop_strings == ("ab",)
    assert SamplingParams(stop=["ab", "c", "ab"]).stop_strings == ("ab", "c")
    assert SamplingParams(stop=[]).stop_strings == ()


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


def test_with_updates_validates_and_copies():
    p = SamplingParams(max_tokens=5, stop="x")
    q = p.with_updates(temperature=0.5, seed=7)
    assert (q.max_tokens, q.temperature, q.seed, q.stop) == (5, 0.5, 7, "x")
    assert p.temperature == 0.0  # unchanged
    with pytest.raises(InvalidParameterError) as info:
        p.with_updates(top_p=0)
    assert info.value.parameter == "top_p"
    with pytest.raises(InvalidParameterError) as info:
        p.with_updates(nonsense=1)
    assert info.value.parameter == "nonsense"


def test_msgspec_roundtrip_and_convert_validate():
    p = SamplingParams(temperature=0.8, stop=["a"], stop_token_ids=[2], logprobs=3)
    assert msgspec.json.decode(msgspec.json.encode(p), type=SamplingParams) == p
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.convert({"top_p": 2.0}, SamplingParams)


def test_docstring_lists_every_field():
    doc = SamplingParams.__doc__ or ""
    for name in SamplingParams.__struct_fields__:
        assert f"{name}:" in doc, name
