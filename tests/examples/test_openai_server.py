"""README.md's client snippet asks for the model name that ``asyncinfer serve`` and examples/openai_server.py
serve the default model under (it was "default" in the example: a 404)."""

from __future__ import annotations

import ast
import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncinfer.server import ModelSpec
from tests.helpers import interrupt

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openai_server.py"


def readme_client_model() -> str:
    """The ``model=`` of the README's openai client snippet (its HTTP section)."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Serving it over HTTP", 1)[1]
    snippet = section.split("```python", 1)[1].split("```", 1)[0]
    assert "OpenAI(base_url=" in snippet
    (name,) = re.findall(r'model="([^"]+)"', snippet)
    return name


def test_the_readme_snippet_asks_for_what_asyncinfer_serve_serves() -> None:
    assert readme_client_model() == ModelSpec.served_name(None) == "SmolLM2-135M-Instruct"


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path) -> None:
    """As ``asyncinfer serve`` does: one line and status 2, at once, not a traceback after the load."""
    missing = tmp_path / "no-such-model"  # loading it would fail: the answer must be about the port
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(missing), "--port", str(port)], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (f"openai_server.py: error: cannot listen on 127.0.0.1:{port} (Address already in use): "
                           "stop the server there, or choose another --host / --port\n")


def _code_lines(tree: ast.Module, source: str) -> int:
    """The example's lines of code: not blank, not a comment, not the module's docstring."""
    lines = source.splitlines()
    spans = {n for node in tree.body[1:] for sub in ast.walk(node) if hasattr(sub, "lineno")
             for n in range(sub.lineno, sub.end_lineno + 1)}
    return sum(1 for n in spans if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#"))


def test_the_example_follows_the_fastapi_guide_with_public_names_only() -> None:
    """The template for one's own app: only the names docs/api.md lists (``asyncinfer`` and
    ``asyncinfer.server``'s ``__all__``; not ``asyncinfer.commands``), the model loaded in the lifespan with
    ``await AsyncEngine.load()`` as docs/guides/fastapi.md advises (never at import), and as short as the
    README says."""
    import asyncinfer
    import asyncinfer.server

    source = EXAMPLE.read_text(encoding="utf-8")
    tree = ast.parse(source)
    public = {"asyncinfer": set(asyncinfer.__all__), "asyncinfer.server": set(asyncinfer.server.__all__)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("asyncinfer"):
            assert node.module in public, node.module
            assert {a.name for a in node.names} <= public[node.module], ast.unparse(node)
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("asyncinfer") for a in node.names), ast.unparse(node)
    assert "from_pretrained" not in source
    (lifespan,) = [n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "lifespan"]
    loads = [n for n in ast.walk(lifespan) if isinstance(n, ast.Await) and "AsyncEngine.load(" in ast.unparse(n)]
    assert len(loads) == 1
    at_import = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.If))]
    calls = [ast.unparse(c.func) for n in at_import for c in ast.walk(n) if isinstance(c, ast.Call)]
    assert not [c for c in calls if c.startswith("AsyncEngine")], calls  # no load at import
    (claim,) = re.findall(r"examples/openai_server\.py` shows it in under (\d+) lines of code",
                          (ROOT / "README.md").read_text(encoding="utf-8").replace("\n", " "))
    assert _code_lines(tree, source) < int(claim)


@pytest.mark.real_model
def test_the_example_serves_the_default_model_under_the_readme_s_name(real_gguf) -> None:
    import httpx
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The key in ASYNCINFER_API_KEY is asked for, as by `asyncinfer serve` (the example's ServerSettings() served
    # everyone, whatever the variable said).
    # So is the metrics key in ASYNCINFER_METRICS_KEY: the example ignored it, while its /metrics refusal said to
    # set it.
    env = {**os.environ, "ASYNCINFER_MODEL": str(real_gguf), "ASYNCINFER_API_KEY": "sk-example",
           "ASYNCINFER_METRICS_KEY": "ops-example",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--port", str(port)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the example did not come up"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        name = readme_client_model()
        assert httpx.get(url + "/v1/models").status_code == 401
        scraped = httpx.get(url + "/metrics", headers={"Authorization": "Bearer ops-example"})
        assert scraped.status_code == 200 and "asyncinfer_requests_in_flight" in scraped.text, scraped.text
        assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-example"}).status_code == 401
        with openai.OpenAI(base_url=url + "/v1", api_key="sk-example", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [name]
            reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi!"}],
                                                   max_tokens=4)
            assert reply.model == name and reply.usage.completion_tokens >= 1
    finally:
        said = interrupt(proc)
    # uvicorn prints no "running on" line for a socket handed to it: the example names its URL itself.
    assert said.startswith(f"openai_server.py: loading, then serving at {url}/v1\n"), said


def test_serving_md_says_how_the_example_refuses_a_port_in_use() -> None:
    """docs/serving.md named a helper (check_port_free) the example never calls: the example binds the
    port itself and hands the socket to run_server."""
    doc = (ROOT / "docs" / "serving.md").read_text()
    sentence = doc[doc.index("`examples/openai_server.py` names them"):][:400].split("\n\n")[0]
    source = EXAMPLE.read_text()
    for name in re.findall(r"`asyncinfer\.[\w.]+\.(\w+)`", sentence):
        assert name in source, f"docs/serving.md says the example uses {name}"
    assert "sock=" in sentence and "sock=sock" in source
