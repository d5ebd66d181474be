"""A newcomer's first hour with the library and the command line (stranger 57).

A transformers user's first ``SamplingParams(max_new_tokens=16)`` was msgspec's bare ``TypeError: Unexpected keyword
argument 'max_new_tokens'``, naming no field, where ``with_updates(max_new_tokens=...)`` listed the fields and
``from_pretrained(torch_dtype=...)`` named ``dtype``; a ``generate --file`` line's ``"max_new_tokens"`` listed the keys
without naming ``max_tokens``.
"""

from __future__ import annotations

import pickle

import pytest

from asyncinfer import InvalidParameterError, SamplingParams, cli
from asyncinfer.sampling_params import UnknownSamplingFieldError

FIELDS = ", ".join(SamplingParams.__struct_fields__)


@pytest.mark.parametrize(("keyword", "hint"), [
    ("max_new_tokens", "max_new_tokens is transformers' name: asyncinfer's is max_tokens"),
    ("num_return_sequences", "num_return_sequences is transformers' name: asyncinfer's is n"),
    ("n_predict", "n_predict is llama.cpp's name: asyncinfer's is max_tokens"),
    ("repeat_penalty", "repeat_penalty is llama.cpp's name: asyncinfer's is repetition_penalty"),
    ("max_completion_tokens", "max_completion_tokens is OpenAI's name: asyncinfer's is max_tokens"),
    ("top_logprobs", "top_logprobs is OpenAI's name: asyncinfer's is logprobs"),
    ("do_sample", ("do_sample has no SamplingParams field: sampling is on where temperature > 0 (greedy, "
                  "temperature=0, is the default)")),
    ("temprature", "did you mean temperature?"),
])
def test_an_unknown_keyword_names_the_field_meant(keyword, hint) -> None:
    with pytest.raises(UnknownSamplingFieldError) as caught:
        SamplingParams(**{keyword: 16})
    error = caught.value
    assert isinstance(error, InvalidParameterError) and isinstance(error, TypeError)
    assert (error.parameter, error.value) == (keyword, 16)
    assert str(error) == f"{keyword}=16 is invalid: allowed a SamplingParams field: {FIELDS}; {hint}"
    with pytest.raises(UnknownSamplingFieldError) as again:  # with_updates says the same
        SamplingParams().with_updates(**{keyword: 16})
    assert str(again.value) == str(error)
    assert type(pickle.loads(pickle.dumps(error))) is UnknownSamplingFieldError


def test_a_keyword_close_to_none_lists_the_fields_alone() -> None:
    with pytest.raises(UnknownSamplingFieldError) as caught:
        SamplingParams(max_tokens=4, zzz=1)
    assert str(caught.value) == f"zzz=1 is invalid: allowed a SamplingParams field: {FIELDS}"


def test_known_keywords_and_bad_values_are_as_before() -> None:
    assert SamplingParams(max_tokens=4, temperature=0.5).max_tokens == 4
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(max_tokens=0)
    assert type(caught.value) is InvalidParameterError


def test_positional_arguments_are_refused_naming_the_keywords() -> None:
    """``SamplingParams(16)`` was msgspec's bare "Extra positional arguments provided", naming no keyword."""
    with pytest.raises(UnknownSamplingFieldError) as caught:
        SamplingParams(16)
    assert isinstance(caught.value, TypeError)
    assert str(caught.value) == ("SamplingParams takes keyword arguments only, not 1 positional (16): e.g. "
                                 f"SamplingParams(max_tokens=16, temperature=0.7); its fields: {FIELDS}")


@pytest.mark.parametrize(("line", "said"), [
    ('{"prompt": "x", "max_new_tokens": 3}',
     ("unknown key(s) \"max_new_tokens\": the keys are prompt, messages, id and SamplingParams' fields (max_tokens, "
     "temperature, stop, ...); max_new_tokens is transformers' name: asyncinfer's is max_tokens")),
    ('{"promt": "x"}', ("unknown key(s) \"promt\": the keys are prompt, messages, id and SamplingParams' fields "
                       "(max_tokens, temperature, stop, ...); did you mean prompt?")),
])
def test_a_generate_line_s_unknown_key_names_the_key_meant(line, said, tmp_path, capsys, no_load) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(line + "\n")
    assert cli.main(["generate", "--file", str(path)]) == 2
    assert capsys.readouterr().err == f"asyncinfer: error: {path} line 1: {said}\n"


class _Name(str):
    """A keyword name of a ``str`` subclass: the error holds the plain text."""


def test_an_odd_keyword_name_is_named_in_a_message_that_can_be_written() -> None:
    """pass66: a lone surrogate as the name made a message no UTF-8 stream or log could write."""
    with pytest.raises(UnknownSamplingFieldError) as caught:
        SamplingParams(**{"\ud800x": 1})
    assert caught.value.parameter == "\\ud800x"
    str(caught.value).encode("utf-8")  # writable, the surrogate escaped
    for make in (lambda: SamplingParams(**{_Name("temprature"): 1.0}),
                 lambda: SamplingParams().with_updates(**{_Name("temprature"): 1.0})):
        with pytest.raises(UnknownSamplingFieldError) as caught:
            make()
        assert type(caught.value.parameter) is str and caught.value.parameter == "temprature"
        assert str(caught.value).endswith("did you mean temperature?")
