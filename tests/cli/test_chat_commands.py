"""The interactive chat's commands: a line that starts with ``/`` and is no command gets a one-line hint and
is not sent to the model; ``//`` sends a message that starts with ``/``."""

from __future__ import annotations

from typing import Any

from asyncinfer.commands.chat import HELP, _session, unknown_command


class Lines:
    """The prompt's lines, as ``_Interrupts`` reads them, then end of input."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = list(lines)

    async def read_line(self, prompt: str, editor: Any) -> str | None:
        return self.lines.pop(0) if self.lines else None

    async def run(self, coro: Any) -> bool:
        await coro
        return True


class Session:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    async def reply(self, text: str) -> str:
        self.sent.append(text)
        return ""


async def test_an_unknown_command_is_answered_with_a_hint_not_sent(capsys) -> None:
    session = Session()
    lines = ["/rest", "/exit now", "hello", "//etc/hosts is a file", "  /Reset", "/reset", "/help"]
    assert await _session(session, Lines(lines), None) == 0  # end of input: leaves with 0
    assert session.sent == ["hello", "/etc/hosts is a file"]
    assert session.resets == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        ("asyncinfer: '/rest' is not a command (/reset, /exit, /quit, /help, /?); to send a message that starts "
         "with /, begin it with //"),
        unknown_command("/exit now"),
        unknown_command("  /Reset"),
        "[history cleared]",
        HELP,
    ]
    assert "'/exit now' is not a command" in err[1]


async def test_exit_still_leaves() -> None:
    session = Session()
    assert await _session(session, Lines(["/exit", "never read"]), None) == 0
    assert session.sent == []


async def test_help_lists_every_command(capsys) -> None:
    """/help (and /?) name every command the session takes, /quit and /? too."""
    from asyncinfer.commands.chat import COMMANDS

    assert await _session(Session(), Lines(["/?"]), None) == 0
    shown = capsys.readouterr().err.strip()
    assert shown == HELP and all(command in shown for command in COMMANDS)
