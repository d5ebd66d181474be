"""InvalidParameterError's message shows the offending value bounded: a huge value (one text repeated in a
long list, a very long text) cannot make raising the error itself a cost for the event loop."""

from __future__ import annotations

import time

import pytest

from asyncinfer.errors import InvalidParameterError


def test_a_short_value_is_shown_as_its_repr() -> None:
    assert str(InvalidParameterError("quantization", "bogus", "one of ...")) == (
        "quantization='bogus' is invalid: allowed one of ...")
    assert str(InvalidParameterError("stop", ("a", "b"), "strings")) == "stop=('a', 'b') is invalid: allowed strings"


@pytest.mark.parametrize("value", [["x" * 200_000] * 500, "y" * 5_000_000, {i: "z" * 10_000 for i in range(10_000)}])
def test_a_huge_value_is_shown_elided_and_kept_whole(value: object) -> None:
    start = time.process_time()
    err = InvalidParameterError("prompt", value, "text or token ids")
    assert time.process_time() - start < 0.5  # the whole repr would be 100 MB for the list
    assert len(str(err)) < 10_000 and "..." in str(err)
    assert err.value is value and err.parameter == "prompt"


def test_an_unknown_option_is_typed_with_the_options_it_was_meant_for() -> None:
    """engine_flags tells a generator's flag given for a sentence encoder by the error's type and its ``options``
    (it read the prefix of the error's ``allowed`` text)."""
    from asyncinfer.config import EngineConfig, UnknownOptionError
    from asyncinfer.embedding import EmbeddingConfig

    with pytest.raises(UnknownOptionError) as caught:
        EmbeddingConfig.from_options({"max_model_len": 64})
    assert caught.value.options is EmbeddingConfig and caught.value.parameter == "max_model_len"
    assert isinstance(caught.value, InvalidParameterError)
    with pytest.raises(UnknownOptionError) as caught:
        EngineConfig.from_options({"n_ctx": 64})
    assert caught.value.options is EngineConfig and "max_model_len" in str(caught.value)


@pytest.mark.parametrize("options", [None, [("dtype", "float32")], "dtype=float32"])
def test_options_that_are_no_dict_are_an_invalid_parameter_error(options: object) -> None:
    """``from_options(None)`` or a list of pairs raised a bare ``AttributeError`` ('list' object has no
    attribute 'items'); docs/api.md promises an ``InvalidParameterError``."""
    from asyncinfer.config import EngineConfig
    from asyncinfer.embedding import EmbeddingConfig

    for cls in (EngineConfig, EmbeddingConfig):
        with pytest.raises(InvalidParameterError) as caught:
            cls.from_options(options)  # type: ignore[arg-type]
        assert caught.value.parameter == "options" and caught.value.value is options
        assert "a dict of option names" in str(caught.value)


def test_the_commands_engine_seed_flag_as_a_keyword_names_the_option() -> None:
    """``--engine-seed`` is the option ``seed``; ``engine_seed=`` was refused listing every option with no hint."""
    from asyncinfer.config import EngineConfig, UnknownOptionError

    with pytest.raises(UnknownOptionError) as caught:
        EngineConfig.from_options({"engine_seed": 3})
    assert str(caught.value).endswith("; engine_seed is the commands' --engine-seed: its option is seed")
