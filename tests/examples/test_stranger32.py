"""A stranger's first hour (stranger32): examples/openai_server.py run the way docs/guides/fastapi.md runs an app.

The example is "your own FastAPI app"; the guide says to run such an app with ``uvicorn app:app``. Run as
``uvicorn openai_server:app`` (from examples/), the example read uvicorn's command line as its own and stopped
with ``uvicorn: error: unrecognized arguments: openai_server:app``, a message that blames uvicorn's own argument.
It reads its flags only when run as a script now; imported by uvicorn it serves the default model.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_imports_under_uvicorn_s_command_line(monkeypatch) -> None:
    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    monkeypatch.delenv("ASYNCINFER_METRICS_KEY", raising=False)
    monkeypatch.setattr(sys, "argv", ["uvicorn", "openai_server:app", "--port", "8000"])  # what uvicorn sees
    module = runpy.run_path(str(ROOT / "examples" / "openai_server.py"), run_name="openai_server")
    assert module["args"].model is None and module["app"].title == "FastAPI"  # not loaded: no lifespan run
