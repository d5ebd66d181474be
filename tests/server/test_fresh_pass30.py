"""pass30: a final adversarial pass as a hostile tenant of a shared server, and as its operator.

examples/openai_server.py read the key variables (``ASYNCINFER_API_KEY``, ``ASYNCINFER_METRICS_KEY``) as it was
imported, outside the ``AsyncInferError`` guard its model load has: a variable ``asyncinfer serve`` refuses in one
line (set but blank, an empty item between commas) ended the example in a traceback, status 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("variable", "value", "shown"), [
    ("ASYNCINFER_API_KEY", "sk-one,,sk-two", "ASYNCINFER_API_KEY='<keys with an empty item between commas>'"),
    ("ASYNCINFER_METRICS_KEY", "", "ASYNCINFER_METRICS_KEY=''"),
])
def test_the_fastapi_example_refuses_a_key_variable_in_one_line(variable: str, value: str, shown: str) -> None:
    """examples/openai_server.py built its settings from the key variables as it was imported, outside the
    ``AsyncInferError`` guard its model load has: a variable ``asyncinfer serve`` refuses in one line (a blank one,
    an empty item between commas) ended the example in a traceback, status 1."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", variable: value}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_server.py"), "--port", "0"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"openai_server.py: error: {shown} is invalid: allowed "), proc.stderr
    assert proc.stderr.count("\n") == 1
