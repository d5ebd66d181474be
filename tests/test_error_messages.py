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
