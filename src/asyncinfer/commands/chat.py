"""``asyncinfer chat``: one-shot or interactive chat, streamed as it is written.

In a session, Ctrl-C stops the reply being written (the request is aborted, the
session goes on); at the prompt it says "stopping…" at once and leaves with status 130 (``/exit``, ``/quit``
and Ctrl-D leave with 0). ``/reset`` forgets the conversation, ``/help`` lists the
commands, and so does an empty line (nothing is sent); ``exit``, ``quit`` or ``bye`` typed without the ``/`` is sent
as a message, then followed by how to leave. Any other line that starts with ``/`` gets a one-line hint and is not sent; a
message that must start with ``/`` is typed with ``//`` (the first ``/`` is dropped). A message of several
lines (pasted text, code) goes between ``\"\"\"`` and ``\"\"\"``, as in Ollama: a line that starts with ``\"\"\"`` opens
it, the lines after it (prompt ``...``) are part of it, and the line that ends with ``\"\"\"`` closes it; each line
typed without them is a message of its own. The history is
trimmed to what fits ``max_model_len`` with room for ``max_tokens`` (oldest turns
first); a message that cannot fit even alone is refused with an
``InvalidParameterError`` on ``message`` and the session goes on.

At a terminal the prompt has line editing and a history of what you typed (the
arrow keys, Ctrl-R; Python's ``readline`` where the platform has it), kept
across sessions in ``$XDG_STATE_HOME/asyncinfer/chat_history``
(``~/.local/state/asyncinfer/chat_history``; ``ASYNCINFER_CHAT_HISTORY`` names
another file, or none when empty), readable by you only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO

from asyncinfer.commands import check_chats_render
from asyncinfer.errors import InvalidParameterError
from asyncinfer.history import trim_messages
from asyncinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on

HELP = ("/reset clears the history, /exit or /quit (or Ctrl-D) leaves, /help or /? shows this, Ctrl-C stops a "
        "reply (at the prompt: leaves); a message that starts with / is sent as //...; a message of several lines "
        "goes between \"\"\" and \"\"\"")
#: What opens and closes a message of several lines (Ollama's convention): each line typed or pasted in between is
#: part of one message, not a message of its own.
MULTILINE = '"""'
#: The prompt of the lines inside a message of several lines.
MORE_PROMPT = "... "
COMMANDS = ("/reset", "/exit", "/quit", "/help", "/?")
#: Lines that are sent as messages but may have meant to leave (they get :data:`LEAVE_HINT` after the reply).
LEAVE_WORDS = ("exit", "quit", "bye", "exit()", "quit()", ":q", "q")
LEAVE_HINT = "(that was sent as a message; to leave, type /exit or press Ctrl-D)"
#: The answer to an empty line at the prompt (nothing is sent to the model).
EMPTY_LINE = f"(nothing sent: type a message, or a command: {HELP})"


def unknown_command(line: str) -> str:
    """The one-line hint for a line that starts with ``/`` but is no command (it is not sent to the model)."""
    return (f"asyncinfer: {line.strip()!r} is not a command ({', '.join(COMMANDS)}); "
            "to send a message that starts with /, begin it with //")

#: The file of the prompt's history: a path, or empty for none (default: :func:`history_path`'s).
HISTORY_ENV = "ASYNCINFER_CHAT_HISTORY"
HISTORY_LENGTH = 1000  # lines kept


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="*", help="one-shot prompt; omit for an interactive session (the model is "
                                             "--model: a prompt that names a model file or directory is refused)")
    p.add_argument("--system", metavar="TEXT", default=None, help="a system message (default: none)")
    p.add_argument("--stats", action="store_true", help="after each reply: tokens, time to first token, tokens/s")


def run_chat(args: argparse.Namespace, options: dict[str, Any], params: SamplingParams) -> int:
    words = args.prompt
    if words and not " ".join(words).strip():
        from asyncinfer.commands import CommandError

        # ``asyncinfer chat "$PROMPT"`` with the variable unset or blank: the model was loaded and answered nothing
        # with a reply of its own, where a session's empty line sends nothing
        raise CommandError(f"the prompt {' '.join(words)!r} is empty (an unset variable?): give the message, or "
                           "omit the prompt for an interactive session")
    if args.model is None and words and (len(words) == 1 and _looks_like_a_model(words[0])
                                         or len(words) > 1 and _names_a_model(words[0])):
        import shlex

        from asyncinfer.commands import CommandError

        # chat's positional is the prompt (every other command's is the model): a model file is a mistake, first
        # of several words too (``asyncinfer chat my.gguf "hi"``, as serve and generate take theirs)
        rest = " ".join(shlex.quote(word) for word in words[1:]) or "[PROMPT]"
        raise CommandError(f"{words[0]!r} is a model, not a prompt (asyncinfer chat's argument is the "
                           f"prompt): give it as --model (asyncinfer chat --model {words[0]} {rest}); to "
                           "send it as the prompt, give --model too")
    return asyncio.run(_main(args, options, params))


def _names_a_model(word: str) -> bool:
    """Whether ``word``, the first of a prompt's several words, surely names a model: an existing ``.gguf`` file or
    directory with a ``config.json``, a word ending in ``.gguf``, or a known name (not a Hub-id-shaped word, which a
    sentence may start with)."""
    from asyncinfer.model_source import known_name

    if any(c.isspace() for c in word) or not word:
        return False
    if known_name(word) or word.lower().endswith(".gguf"):
        return True
    try:
        path = Path(os.path.expanduser(word))
        return (path.suffix.lower() == ".gguf" and path.is_file()) or (path.is_dir() and (path / "config.json").is_file())
    except (OSError, ValueError):  # too long for a file name, or with a NUL: no file
        return False


def _looks_like_a_model(text: str) -> bool:
    """Whether ``text`` names a model rather than says something: an existing ``.gguf`` file or directory with a
    ``config.json``, a word ending in ``.gguf`` (a model file mistyped or not there yet), one of the known names
    (``SmolLM2-135M-Instruct``), or a Hugging Face Hub id (``OWNER/NAME`` with a ``-``, ``.`` or a digit in the
    name, as model names have and words such as "and/or" do not)."""
    from asyncinfer.model_source import is_hub_id, known_name

    word = text.strip()
    if not word or any(c.isspace() for c in word):
        return False
    if known_name(word) or word.lower().endswith(".gguf"):
        return True
    try:
        path = Path(os.path.expanduser(word))
        if (path.suffix.lower() == ".gguf" and path.is_file()) or (path.is_dir() and (path / "config.json").is_file()):
            return True
    except (OSError, ValueError):  # a prompt too long for a file name, or with a NUL: no file
        return False
    name = word.partition("/")[2]
    return is_hub_id(word) and any(c.isalpha() for c in word.partition("/")[0]) and any(
        c.isdigit() or c in "-." for c in name)


class ChatSession:
    """A conversation with one engine: the history, and one reply at a time written to ``out``."""

    def __init__(self, engine: Any, params: SamplingParams, system: str | None, *, stats: bool = False,
                 out: TextIO | None = None, err: TextIO | None = None, max_tokens_given: bool = True,
                 context_given: bool = True) -> None:
        self.engine = engine
        self.params = params
        self.max_tokens_given = max_tokens_given  # False: params.max_tokens is --max-tokens' default
        self.context_given = context_given  # False: max_model_len is the model's whole context (no --max-model-len)
        self.system = [{"role": "system", "content": system}] if system else []
        self.history: list[dict[str, str]] = list(self.system)
        self.stats = stats
        # The streams of the moment (not of import time: a redirected sys.stdout may be closed later).
        self.out = sys.stdout if out is None else out
        self.err = sys.stderr if err is None else err

    def reset(self) -> None:
        self.history = list(self.system)

    def _refused(self, text: str, budget: int, exc: InvalidParameterError) -> InvalidParameterError:
        """``exc`` (about the rendered prompt or the history) as an error about the message the user typed."""
        if exc.parameter not in ("prompt", "messages"):  # e.g. "prompt[1]": a text that is not valid Unicode
            return InvalidParameterError("message", exc.value, exc.allowed)
        if exc.value == "chat messages":  # the template raised (Gemma's: no system role): not a question of length
            reason = exc.allowed.removeprefix("messages this model's chat template accepts (").removesuffix(")")
            system = " (the --system message included)" if self.system else ""
            return InvalidParameterError("message", f"<{len(text)} characters>", exc.allowed,
                                         message=f"the model's chat template refuses this conversation{system}: "
                                                 f"{reason}")
        system = ", with the system message," if self.system else ""
        max_model_len = self.engine.max_model_len
        fix = "shorten it, or raise --max-model-len or lower --max-tokens"
        try:  # as the engine renders it: the message (and the system message) in the chat template
            need = self.engine.count_tokens([*self.system, {"role": "user", "content": text}])
        except InvalidParameterError:  # refused by its characters, before any tokenization
            need = None
        if need is not None:
            system = " and the system message" if self.system else ""
            room = max_model_len - need
            fix = (f"rendered with the chat template it takes {need} tokens (the message{system} and the template's "
                   f"own): shorten it, or raise --max-model-len"
                   + (f" or lower --max-tokens to at most max_model_len - tokens = {max_model_len} - {need} = {room}"
                      if room >= 1 else ""))
            system = ", with the system message," if self.system else ""
        return InvalidParameterError(
            "message", f"<{len(text)} characters>",
            f"a message that{system} fits in {budget} tokens (max_model_len {max_model_len} - "
            f"max_tokens {self.params.max_tokens}); {fix}",
        )

    async def reply(self, text: str) -> str:
        """Stream the answer to ``text``; cancelling the task stops it (the partial answer is kept).

        Raises:
            InvalidParameterError: on ``message`` when ``text`` (with the system message) cannot fit
                ``max_model_len - max_tokens`` tokens; the history is left as it was.
        """
        budget = self.engine.max_model_len - self.params.max_tokens
        if budget < 1:  # named by the flags the user can change
            limit, n = self.params.max_tokens, self.engine.max_model_len
            default = "" if self.max_tokens_given else " (its default)"
            fix = "lower --max-tokens" if self.max_tokens_given else f"give --max-tokens under {n}"
            bound = f"--max-model-len ({n})" if self.context_given else f"the model's context ({n} tokens, the " \
                "default --max-model-len)"
            raise InvalidParameterError(
                "max_tokens", limit, f"less than {bound}",
                message=f"--max-tokens {limit}{default} is invalid: allowed less than {bound}; {fix}"
                        + (" or raise --max-model-len" if self.context_given else ""))
        self.history.append({"role": "user", "content": text})
        try:
            self.history = trim_messages(self.history, budget, self.engine.count_tokens)
        except InvalidParameterError as exc:
            self.history.pop()
            raise self._refused(text, budget, exc) from exc
        pieces: list[str] = []
        start, first, tokens, reason = time.perf_counter(), None, 0, "abort"
        try:
            async for delta in self.engine.stream(self.history, self.params):
                first = first or time.perf_counter()
                tokens += len(delta.token_ids)
                pieces.append(delta.text)
                self.out.write(delta.text)
                self.out.flush()
                reason = delta.finish_reason or reason
        except asyncio.CancelledError:
            self.out.write(" [stopped]")
            raise
        finally:
            self.out.write("\n")
            self.out.flush()
            self.history.append({"role": "assistant", "content": "".join(pieces)})
            if self.stats and first is not None:
                total = time.perf_counter() - start
                rate = (tokens - 1) / (total - (first - start)) if tokens > 1 and total > first - start else 0.0
                print(f"[{tokens} tokens, finish={reason}, TTFT {1000 * (first - start):.0f} ms, "
                      f"{rate:.1f} tokens/s]", file=self.err)
        return "".join(pieces)


async def _main(args: argparse.Namespace, options: dict[str, Any], params: SamplingParams) -> int:
    from asyncinfer.engine import AsyncEngine

    engine = await AsyncEngine.load(args.model, **options)
    async with engine:
        check_chats_render(engine.get_tokenizer(), args.model, "chat")
        session = ChatSession(engine, params, args.system, stats=args.stats,
                              max_tokens_given=args.max_tokens is not None,
                              context_given=options.get("max_model_len") is not None)
        with _Interrupts() as interrupts:
            if args.prompt:
                return 0 if await interrupts.run(session.reply(" ".join(args.prompt))) else 130
            print(f"asyncinfer chat: {HELP}", file=sys.stderr)
            with LineEditor.for_terminal() as editor:
                return await _session(session, interrupts, editor)


async def _session(session: ChatSession, interrupts: _Interrupts, editor: LineEditor) -> int:
    """The interactive loop: 0 when the user leaves (/exit, Ctrl-D), 130 on Ctrl-C at the prompt."""
    while True:
        try:
            line = await interrupts.read_line("> ", editor)
        except PromptInterrupted:
            return 130
        if line is None:  # Ctrl-D (end of input): the shell's prompt on a fresh line
            print(flush=True)
            return 0
        if line.lstrip().startswith(MULTILINE):  # a message of several lines: read up to its closing """
            try:
                line = await _read_multiline(line.lstrip()[len(MULTILINE):], interrupts, editor)
            except PromptInterrupted:
                return 130
            if line is None:  # Ctrl-D before the closing """: nothing sent
                print("\n(nothing sent: the message was not closed with \"\"\")", file=sys.stderr, flush=True)
                return 0
            if not line.strip():
                print(EMPTY_LINE, file=sys.stderr)
                continue
            await _send(session, interrupts, line)
            continue
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command.startswith("//"):  # the escape: a message that starts with /, sent without the first /
            line = line.replace("/", "", 1)
            command = line.strip()
        elif command == "/reset":
            session.reset()
            print("[history cleared]", file=sys.stderr)
            continue
        elif command in ("/help", "/?"):
            print(HELP, file=sys.stderr)
            continue
        elif command.startswith("/"):  # a mistyped command (/rest, /exit now) is not sent to the model
            print(unknown_command(line), file=sys.stderr)
            continue
        if not command:  # an empty line is not sent: what can be typed instead
            print(EMPTY_LINE, file=sys.stderr)
            continue
        await _send(session, interrupts, line)
        if command.lower() in LEAVE_WORDS:  # sent, as any message; said how to leave, in case that was meant
            print(LEAVE_HINT, file=sys.stderr)


async def _send(session: ChatSession, interrupts: _Interrupts, text: str) -> None:
    try:
        await interrupts.run(session.reply(text))
    except InvalidParameterError as exc:
        print(f"asyncinfer: {exc}", file=sys.stderr)


async def _read_multiline(first: str, interrupts: _Interrupts, editor: LineEditor) -> str | None:
    """The message of several lines whose opening ``\"\"\"`` line held ``first`` after the quotes: the lines up to
    the one that ends with ``\"\"\"``, joined by newlines (the quotes dropped); None at end of input.

    Raises:
        PromptInterrupted: Ctrl-C while a line is read.
    """
    lines: list[str] = []
    line: str | None = first
    while line is not None:
        closed = line.rstrip().endswith(MULTILINE) and (bool(lines) or line.strip() != "")  # (not the opening's)
        if closed:
            lines.append(line.rstrip()[:-len(MULTILINE)])
            return "\n".join(lines).strip("\n")
        lines.append(line)
        line = await interrupts.read_line(MORE_PROMPT, editor)
    return None


class PromptInterrupted(Exception):
    """Ctrl-C at the prompt: the session ends (status 130)."""


def history_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """The chat's history file: ``ASYNCINFER_CHAT_HISTORY`` (empty: no file), else
    ``$XDG_STATE_HOME/asyncinfer/chat_history`` (``~/.local/state`` when the variable is unset)."""
    env = os.environ if environ is None else environ
    if HISTORY_ENV in env:
        return Path(os.path.expanduser(env[HISTORY_ENV])) if env[HISTORY_ENV] else None
    state = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "asyncinfer" / "chat_history"


class LineEditor:
    """Line editing and history for the prompt, where ``input()`` reads a terminal.

    ``readline`` is the platform's module (None where there is none, or where stdin is not a
    terminal: then ``input()`` reads plain lines and no history is kept). Entering it loads
    the history file; leaving it writes the file (mode 0600) and puts the terminal back as it
    was (a Ctrl-C ends the session while ``readline`` holds the terminal in its own mode).
    """

    def __init__(self, readline: ModuleType | None, path: Path | None, fd: int | None = None, *,
                 terminal: bool = False) -> None:
        self.readline = readline
        self.path = path
        self.fd = fd  # the terminal whose settings are restored
        self.terminal = terminal  # input() reads it; else lines are read from the file descriptor itself
        self._saved: Any = None
        self._pending = b""

    def read(self, prompt: str) -> str | None:
        """One line (without its end), or None at end of input; blocks (call it off the event loop).

        Not at a terminal the line is read from file descriptor 0 itself, not through ``sys.stdin``: a
        thread left waiting in ``sys.stdin`` when Ctrl-C ends the session holds its lock, and the
        interpreter aborts at exit (SIGABRT) when it flushes the standard streams."""
        if self.terminal:
            try:
                return input(prompt)
            except (EOFError, OSError, ValueError):
                return None
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while b"\n" not in self._pending:
            try:
                chunk = os.read(0, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                line, self._pending = self._pending, b""
                return line.decode("utf-8", "replace") if line else None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode("utf-8", "replace").removesuffix("\r")

    @classmethod
    def for_terminal(cls) -> LineEditor:
        """The editor for this process's stdin: ``readline`` when stdin and stdout are terminals."""
        try:
            interactive = sys.stdin.isatty() and sys.stdout.isatty()
        except (AttributeError, ValueError):  # a closed or replaced stream
            interactive = False
        if not interactive:
            return cls(None, None)
        try:
            import readline
        except ImportError:  # not built on this platform: plain input()
            return cls(None, None, sys.stdin.fileno(), terminal=True)
        return cls(readline, history_path(), sys.stdin.fileno(), terminal=True)

    def __enter__(self) -> Self:
        if self.fd is not None:
            with contextlib.suppress(ImportError, OSError):
                import termios

                self._saved = termios.tcgetattr(self.fd)
        if self.readline is not None:
            self.readline.set_history_length(HISTORY_LENGTH)
            if self.path is not None and self.path.is_file():
                with contextlib.suppress(OSError):
                    self.readline.read_history_file(str(self.path))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            with contextlib.suppress(ImportError, OSError):
                import termios

                termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
        if self.readline is None or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch(mode=0o600, exist_ok=True)
            self.readline.write_history_file(str(self.path))
            self.path.chmod(0o600)
        except OSError as error:
            print(f"asyncinfer chat: the history was not saved: {error.strerror or error}: {self.path} "
                  f"({HISTORY_ENV}= keeps none)", file=sys.stderr)


class _Interrupts:
    """Ctrl-C stops the running reply, or, with none running, ends the wait for input.

    ``input()`` runs in a daemon thread (a worker of the default executor would
    keep the process alive at exit while it waits for a line).
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.current: asyncio.Future[Any] | None = None

    def __enter__(self) -> Self:
        with contextlib.suppress(NotImplementedError, RuntimeError):  # no signal handlers here (Windows)
            self.loop.add_signal_handler(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            self.loop.remove_signal_handler(signal.SIGINT)

    def _interrupt(self) -> None:
        if self.current is not None and not self.current.done():
            self.current.cancel()

    async def run(self, coro: Any) -> bool:
        """Run ``coro`` until it ends (True) or Ctrl-C cancels it (False)."""
        self.current = asyncio.ensure_future(coro)
        try:
            await self.current
            return True
        except asyncio.CancelledError:
            if not self.current.cancelled():  # we were cancelled ourselves, not the reply
                raise
            return False
        finally:
            self.current = None

    async def read_line(self, prompt: str, editor: LineEditor) -> str | None:
        """A line from stdin; None at end of input.

        Raises:
            PromptInterrupted: Ctrl-C while waiting for the line.
        """
        future: asyncio.Future[str | None] = self.loop.create_future()

        def read() -> None:
            line = editor.read(prompt)
            self.loop.call_soon_threadsafe(lambda: future.done() or future.set_result(line))

        threading.Thread(target=read, name="asyncinfer-chat-input", daemon=True).start()
        self.current = future
        try:
            return await future
        except asyncio.CancelledError:
            if not future.cancelled():
                raise
            # at once: closing the engine (its thread, the model's memory) may take seconds after this
            print("\nstopping…", file=sys.stderr, flush=True)
            raise PromptInterrupted from None
        finally:
            self.current = None
