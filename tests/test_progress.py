"""Progress lines: on a terminal only, after a second, silenced by ASYNCINFER_PROGRESS=0."""

from __future__ import annotations

import io

from asyncinfer import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def terminal(monkeypatch) -> Terminal:
    """Patched in the test's body: pytest's capture sets sys.stderr again after the fixtures ran."""
    fake = Terminal()
    monkeypatch.setattr("sys.stderr", fake)
    monkeypatch.delenv("ASYNCINFER_PROGRESS", raising=False)
    return fake


def test_a_long_load_shows_progress_on_a_terminal(monkeypatch) -> None:
    stderr = terminal(monkeypatch)
    clock = iter([0.0, 0.5, 1.5, 2.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = progress.TerminalProgress("loading model.gguf", "tensors")
    bar(1, 4)  # 0.5 s in: too early to bother
    assert stderr.getvalue() == ""
    bar(2, 4)
    bar(4, 4)
    assert stderr.getvalue() == ("\r[asyncinfer] loading model.gguf:  50% (2/4 tensors)"
                                 "\r[asyncinfer] loading model.gguf: 100% (4/4 tensors)\n")
    progress.say("hello")
    assert stderr.getvalue().endswith("[asyncinfer] hello\n")


def test_silent_without_a_terminal_or_when_turned_off(monkeypatch) -> None:
    stderr = terminal(monkeypatch)
    monkeypatch.setenv("ASYNCINFER_PROGRESS", "0")
    progress.say("hidden")
    monkeypatch.delenv("ASYNCINFER_PROGRESS")
    monkeypatch.setattr(stderr, "isatty", lambda: False)
    progress.say("hidden too")
    bar = progress.TerminalProgress("x")
    bar.start -= 10
    bar(1, 1)
    assert stderr.getvalue() == ""
