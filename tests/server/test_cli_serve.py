"""``asyncinfer serve`` as a user runs it: a process on a loopback port, driven by the openai client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from asyncinfer import cli
from tests.helpers import interrupt

SRC = Path(__file__).resolve().parents[2] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, url: str) -> None:
    """Until ``asyncinfer serve`` (``proc``) answers ``/health`` at ``url``; fails if it exits or takes 120 s."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "asyncinfer serve did not come up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)

def test_serve_runs_the_openai_api_until_interrupted(tiny_chat_model, minilm_dir) -> None:
    port = free_port()
    path = f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "ASYNCINFER_API_KEY": "from-env", "PYTHONPATH": path}
    command = [sys.executable, "-m", "asyncinfer.cli", "serve", str(tiny_chat_model), "--served-model-name", "tiny",
               "--embedding-model", str(minilm_dir), "--host", "127.0.0.1", "--port", str(port),
               "--api-key", "from-flag", "--max-model-len", "512", "--kv-cache-memory", str(4 * 1024 * 1024),
               "--dtype", "float32", "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url)
        for key in ("from-env", "from-flag"):
            with openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as client:
                assert {m.id for m in client.models.list().data} == {"tiny", minilm_dir.name}
                out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=5, extra_body={"ignore_eos": True})
                assert out.usage.completion_tokens == 5
                assert len(client.embeddings.create(model=minilm_dir.name, input="hi").data[0].embedding) == 384
        with (openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as client,
              pytest.raises(openai.AuthenticationError)):
            client.models.list()
    finally:
        output = interrupt(proc)
    assert proc.returncode == 130, output  # Ctrl-C ends serve with 130, as the README says of every command


def test_serve_started_with_sigint_ignored_still_ends_130_on_sigint(tiny_chat_model) -> None:
    """A serve started where SIGINT is ignored (``cmd &`` in a shell without job control, ``nohup``) and stopped
    with ``kill -INT`` shut down as one stopped by Ctrl-C, but exited 0: uvicorn re-raises the signal for Python's
    KeyboardInterrupt, which an ignored SIGINT never becomes."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("ASYNCINFER_API_KEY", None)
    command = [sys.executable, "-m", "asyncinfer.cli", "serve", str(tiny_chat_model), "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", "512", "--kv-cache-memory", str(4 * 1024 * 1024),
               "--dtype", "float32", "--device", "cpu", "--log-level", "warning"]
    ignoring = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]  # SIGINT ignored, as the exec'd serve starts
    proc = subprocess.Popen(ignoring, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(proc, f"http://127.0.0.1:{port}")
    finally:
        output = interrupt(proc)
    assert proc.returncode == 130, output


def test_serve_refuses_a_bad_model_in_one_line(capsys) -> None:
    assert cli.main(["serve", "/no/such/model", "--port", "0"]) == 2  # (port 8000 may be another server's)
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.real_model
def test_a_forced_quit_aborts_the_streams_and_closes_without_a_traceback(real_gguf) -> None:
    """A second Ctrl-C while a stream runs (uvicorn's "CTRL+C to force quit") aborts it: the stream ends with
    ``finish_reason`` ``abort`` and ``[DONE]``, the engine closes, and serve exits 130 without a traceback.
    Before, uvicorn skipped the app's shutdown and the loop's close cancelled the request and the lifespan:
    two tracebacks, the stream cut mid-body, the engine never closed."""
    import json
    import threading

    port = free_port()
    path = f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("ASYNCINFER_API_KEY", None)
    command = [sys.executable, "-m", "asyncinfer.cli", "serve", str(real_gguf), "--port", str(port), "--threads", "1",
               "--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--log-level", "warning"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    seen: list[dict] = []
    ended: list[str] = []
    first = threading.Event()

    def read_stream() -> None:
        body = {"prompt": "Once", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        ended.append("[DONE]")
                    elif line.startswith("data: "):
                        seen.append(json.loads(line[6:]))
                        first.set()
        except httpx.HTTPError as exc:
            ended.append(repr(exc))
        first.set()

    reader = threading.Thread(target=read_stream)
    try:
        wait_until_serving(proc, url)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGINT)  # uvicorn waits for the stream, "(CTRL+C to force quit)"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        reader.join(60)
    assert ended == ["[DONE]"], (ended, output)
    assert seen[-1]["choices"][0]["finish_reason"] == "abort"
    assert len(seen) < 900  # it was aborted, not run to its end
    assert "Traceback" not in output, output
    assert proc.returncode == 130, output
