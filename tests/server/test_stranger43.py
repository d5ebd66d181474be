"""Faults a new user met serving over HTTP: each test fails before its fix."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncinfer.errors import InvalidParameterError
from asyncinfer.server import ServerSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("field", ["header_timeout", "body_timeout", "send_timeout"])
def test_an_infinite_timeout_is_refused_as_not_finite(field: str) -> None:
    # `--header-timeout inf` (or 1e400) said "allowed a number of seconds > 0", which inf is.
    with pytest.raises(InvalidParameterError) as info:
        ServerSettings(**{field: math.inf})
    assert info.value.parameter == field
    assert "a finite number of seconds > 0" in str(info.value)


def test_the_fastapi_example_refuses_an_empty_served_model_name() -> None:
    # `--served-model-name "$UNSET"` served the model as SmolLM2-135M-Instruct (read as "not given"), where
    # `asyncinfer serve` refuses the same flag in one line.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_server.py"), "--port", "0",
                           "--served-model-name", ""], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == ("openai_server.py: error: --served-model-name '' is invalid: allowed a "
                                            "non-empty string of at most 200 characters")
