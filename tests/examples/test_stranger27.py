"""examples/openai_server.py, a newcomer's mistake (stranger 27): a key variable the server refuses
(``ASYNCINFER_API_KEY=" "``, a trailing comma, a key that is not printable ASCII) ended in a traceback of the
``InvalidParameterError`` raised while the module built its settings; it is one line and status 2, before the
model loads, as ``asyncinfer serve`` says it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openai_server.py"


@pytest.mark.parametrize(("variable", "value"), [("ASYNCINFER_API_KEY", " "), ("ASYNCINFER_API_KEY", "sk-x,"),
                                                 ("ASYNCINFER_METRICS_KEY", ",")])
def test_a_key_variable_the_server_refuses_is_one_line(variable, value) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", variable: value}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--port", "0"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"openai_server.py: error: {variable}=") and proc.stderr.count("\n") == 1
    assert "loading, then serving" not in proc.stdout  # refused before the port is taken or the model loads
