"""examples/openai_server.py, a newcomer's mistakes (stranger 17): one line and status 2, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openai_server.py"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(EXAMPLE), *argv], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def test_a_port_beyond_65535_is_refused_in_one_line() -> None:
    """``--port 99999`` ended in socket.bind's ``OverflowError: bind(): port must be 0-65535.`` traceback."""
    proc = _run("--port", "99999")
    assert proc.returncode == 2
    assert proc.stderr.endswith("openai_server.py: error: --port 99999 is not a TCP port (0 to 65535)\n"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_model_that_does_not_load_is_one_line(tmp_path) -> None:
    """A wrong ``--model`` failed in the lifespan and the example ended on run_server's re-raised
    ``ModelLoadError`` with two chained tracebacks (status 1); ``asyncinfer serve`` says it in one line."""
    missing = tmp_path / "no-such-model"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _run("--model", str(missing), "--port", str(port))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"openai_server.py: error: loading '{missing}' failed: model path '{missing}' does not exist (expected a "
        "Hugging Face model directory with config.json and *.safetensors, a .gguf file, or a known name: "
        "'SmolLM2-135M-Instruct', 'all-MiniLM-L6-v2'; model hubs are not contacted)")
