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
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"[history cleared]" in err and b"Traceback" not in err


def chat_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "ASYNCINFER_CHAT_HISTORY": str(tmp_path / "history"), "TERM": "xterm"}


def test_ctrl_c_at_the_prompt_ends_the_session_with_130(real_gguf, tmp_path) -> None:
    """README: Ctrl-C ends a command with status 130; at an empty prompt it leaves the session (was 0)."""
    command = [sys.executable, "-m", "asyncinfer", "chat", "--model", str(real_gguf), "--max-model-len", "256"]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=chat_env(tmp_path))
    try:
        read_until(proc, b"> ")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)  # stdin stays open: the session ends by the interrupt, not by end of input
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdin.close()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and not (tmp_path / "history").exists()  # no terminal: no history kept
    assert err.endswith("\nstopping…\n".encode()), err.decode()  # said at once: closing the engine takes a while


async def test_a_message_too_long_for_the_model_is_refused_naming_the_message(real_gguf) -> None:
    """The error named ``prompt`` (the rendered chat) or ``messages`` (the history): the user typed a
    message, and that is what it now names, with the budget it must fit and what to change."""
    import io

    from asyncinfer import InvalidParameterError
    from asyncinfer.commands.chat import ChatSession

    async with await AsyncEngine.load(real_gguf, max_model_len=256) as engine:
        session = ChatSession(engine, SamplingParams(max_tokens=16), None, out=io.StringIO(), err=io.StringIO())
        # Refused by its characters (untokenized), and by its tokens (2000 characters, about 400 tokens).
        for text in ("word " * 20_000, "word " * 400):
            with pytest.raises(InvalidParameterError) as err:
                await session.reply(text)
            assert err.value.parameter == "message" and err.value.value == f"<{len(text)} characters>"
            assert "fits in 240 tokens (max_model_len 256 - max_tokens 16)" in err.value.allowed
            assert "prompt" not in str(err.value) and session.history == []
        # A short message that does not fit only with the chat template's own tokens: the count says so.
        session = ChatSession(engine, SamplingParams(max_tokens=250), None, out=io.StringIO(), err=io.StringIO())
        need = engine.count_tokens([{"role": "user", "content": "hi"}])
        assert need > 6  # the template's tokens, not the 2 characters, are what does not fit
        with pytest.raises(InvalidParameterError) as err:
            await session.reply("hi")
        assert err.value.allowed == (
            f"a message that fits in 6 tokens (max_model_len 256 - max_tokens 250); rendered with the chat template "
            f"it takes {need} tokens (the message and the template's own): shorten it, or raise --max-model-len or "
            f"lower --max-tokens to at most max_model_len - tokens = 256 - {need} = {256 - need}")
        assert session.history == []


def test_ctrl_d_at_the_prompt_leaves_with_the_shell_prompt_on_a_fresh_line(real_gguf, tmp_path) -> None:
    """End of input at the prompt leaves with status 0, after a newline (the shell's prompt used to
    follow "> " on the same line)."""
    command = [sys.executable, "-m", "asyncinfer", "chat", "--model", str(real_gguf), "--max-model-len", "256"]
    proc = subprocess.run(command, input=b"", capture_output=True, env=chat_env(tmp_path), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == b"> \n" and b"Traceback" not in proc.stderr


class Terminal:
    """``asyncinfer chat`` on a pseudo-terminal (stdin and stdout), as a user at a terminal runs it."""

    def __init__(self, model: Path, tmp_path: Path) -> None:
        import pty
        import termios

        self.master, self.slave = pty.openpty()
        self.initial = termios.tcgetattr(self.slave)  # echo and line mode, as a fresh terminal has them
        command = [sys.executable, "-m", "asyncinfer", "chat", "--model", str(model), "--max-model-len", "256",
                   "--max-tokens", "4"]
        self.proc = subprocess.Popen(command, stdin=self.slave, stdout=self.slave, stderr=subprocess.PIPE,
                                     env=chat_env(tmp_path), close_fds=True)
        self.seen = b""

    def read_until(self, marker: bytes, timeout: float = 120.0) -> None:
        import select

        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            assert time.monotonic() < deadline, f"no {marker!r} in {self.seen[-500:]!r}"
            if select.select([self.master], [], [], 0.2)[0]:
                self.seen += os.read(self.master, 4096)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def end(self, timeout: float = 60.0) -> tuple[int, bytes]:
        """The exit status (the session must end by itself within ``timeout``) and stderr."""
        import select

        try:
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None:
                assert time.monotonic() < deadline, f"the session goes on: {self.seen[-500:]!r}"
                if select.select([self.master], [], [], 0.1)[0]:
                    self.seen += os.read(self.master, 4096)
            return self.proc.returncode, self.proc.stderr.read()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            os.close(self.master)
            os.close(self.slave)


LEFT, UP = b"\x1b[D", b"\x1b[A"


def test_a_terminal_prompt_has_line_editing_and_a_kept_history(real_gguf, tmp_path) -> None:
    """At a terminal the arrow keys edit the line (readline) and recall earlier lines, across sessions, from
    the history file (mode 0600). Without line editing the keys' escape codes would reach the line, "/exit"
    would not be seen and the session would go on."""
    import termios

    first = Terminal(real_gguf, tmp_path)
    first.read_until(b"> ")
    first.type(b"/eit" + LEFT + LEFT + b"x\r")  # "/e|it" -> "/exit"
    code, err = first.end()
    assert code == 0, err.decode()
    history = tmp_path / "history"
    assert "/exit" in history.read_text().splitlines() and (history.stat().st_mode & 0o777) == 0o600

    second = Terminal(real_gguf, tmp_path)
    second.read_until(b"> ")
    second.type(UP + b"\r")  # the line of the last session
    code, err = second.end()
    assert code == 0, err.decode()

    third = Terminal(real_gguf, tmp_path)
    third.read_until(b"> ")
    third.type(b"half a line")
    third.read_until(b"half a line")  # readline echoes it: it holds the terminal in its own mode now
    slave = third.slave
    third.proc.send_signal(signal.SIGINT)
    code, err = third.proc.wait(timeout=60), third.proc.stderr.read()
    assert code == 130, err.decode()
    modes = termios.ECHO | termios.ICANON
    assert third.initial[3] & modes == modes
    assert termios.tcgetattr(slave)[3] & modes == modes  # the terminal is left as it was found
    os.close(third.master)
    os.close(slave)


def test_a_model_given_as_the_prompt_is_refused(tmp_path, capsys, monkeypatch) -> None:
    """``asyncinfer chat PATH.gguf``: chat's positional is the prompt; a prompt that names a model (a .gguf
    file, a directory with config.json) is one line naming --model, status 2, before any load."""
    import asyncinfer.engine

    async def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(asyncinfer.engine.AsyncEngine, "load", no_load)
    gguf = tmp_path / "m.GGUF"
    gguf.write_bytes(b"GGUF")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for given in (str(gguf), str(hf)):
        assert cli.main(["chat", given]) == 2
        err = capsys.readouterr().err
        assert err == (f"asyncinfer: error: {given!r} is a model, not a prompt (asyncinfer chat's argument is the "
                       f"prompt): give it as --model (asyncinfer chat --model {given} [PROMPT]); to send it as the "
                       "prompt, give --model too\n")
    # Words that are not a model: a prompt, a missing .gguf, a directory without config.json, a long text
    for prompt in ("hi", str(tmp_path / "none.gguf"), str(tmp_path), "x" * 5000):
        assert cli.main(["chat", "--model", str(hf), prompt]) == 1  # got as far as the load
        assert "AssertionError: the model was loaded" in capsys.readouterr().err


def test_max_tokens_past_the_context_names_the_flags(capsys) -> None:
    """``chat --max-model-len 10 hi`` (max_tokens 128 by default): the error names the flags to change."""
    from asyncinfer.commands.chat import ChatSession
    from asyncinfer.errors import InvalidParameterError

    class Engine:
        max_model_len = 10

    session = ChatSession(Engine(), SamplingParams(max_tokens=128), None)
    with pytest.raises(InvalidParameterError) as err:
        asyncio.run(session.reply("hi"))
    assert err.value.parameter == "max_tokens" and err.value.value == 128
    assert str(err.value) == ("--max-tokens 128 is invalid: allowed less than --max-model-len (10); lower "
                              "--max-tokens or raise --max-model-len")
    assert session.history == []
