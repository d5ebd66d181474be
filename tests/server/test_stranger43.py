"""Faults a new user met serving over HTTP: each test fails before its fix."""

from __future__ import annotations

import math

import pytest

from asyncinfer.errors import InvalidParameterError
from asyncinfer.server import ServerSettings


@pytest.mark.parametrize("field", ["header_timeout", "body_timeout", "send_timeout"])
def test_an_infinite_timeout_is_refused_as_not_finite(field: str) -> None:
    # `--header-timeout inf` (or 1e400) said "allowed a number of seconds > 0", which inf is.
    with pytest.raises(InvalidParameterError) as info:
        ServerSettings(**{field: math.inf})
    assert info.value.parameter == field
    assert "a finite number of seconds > 0" in str(info.value)
