"""``asyncinfer chat``: one-shot output equals the engine's, and in a session Ctrl-C stops only the reply."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, SamplingParams, cli

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]


def test_one_shot_prints_what_the_engine_generates(real_gguf, capsys) -> None:
    assert cli.main(["chat", "What is the capital of France?", "--model", str(real_gguf), "--system",
                     "Answer in one sentence.", "--max-tokens", "20", "--max-model-len", "512"]) == 0
    printed = capsys.readouterr().out

    async def expected() -> str:
        async with await AsyncEngine.load(real_gguf, max_model_len=512) as engine:
            messages = [{"role": "system", "content": "Answer in one sentence."},
                        {"role": "user", "content": "What is the capital of France?"}]
            return (await engine.generate(messages, SamplingParams(max_tokens=20))).text

    assert printed == asyncio.run(expected()) + "\n"


def read_until(proc: subprocess.Popen, marker: bytes, timeout: float = 120.0) -> bytes:
    """Bytes from the process' stdout until ``marker`` appears (os.read: no buffering surprises)."""
    data = b""
    deadline = time.monotonic() + timeout
    while marker not in data:
        assert time.monotonic() < deadline, f"no {marker!r} in {data[-500:]!r}"
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, f"the process ended: {data[-500:]!r}"
        data += chunk
    return data


def test_ctrl_c_stops_the_reply_and_the_session_goes_on(real_gguf) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "asyncinfer", "chat", "--model", str(real_gguf), "--max-model-len", "2048",
               "--max-tokens", "1500", "--ignore-eos"]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        read_until(proc, b"> ")
        proc.stdin.write(b"Count from one to one thousand in words.\n")
        proc.stdin.flush()
        read_until(proc, b" ")  # the reply is being written
        proc.send_signal(signal.SIGINT)
        read_until(proc, b" [stopped]\n> ")  # stopped, and the next prompt: the session goes on
        proc.stdin.write(b"/reset\n/exit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"[history cleared]" in err and b"Traceback" not in err
