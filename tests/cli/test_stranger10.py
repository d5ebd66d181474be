"""A tenth stranger's first hour with the command line: what misled, each held to its fix."""

from __future__ import annotations

import argparse

import pytest

from asyncinfer import cli
from tests.helpers import cli_commands, cli_refusal


# ------------------------------------------------------------------------- flags before the command
@pytest.mark.parametrize(("argv", "message"), [
    (["-m", "x.gguf", "chat"],
     "flags come after the command: asyncinfer chat -m x.gguf (-m is a flag of asyncinfer chat, not of asyncinfer)"),
    (["-t", "1", "chat", "hi there"],
     ("flags come after the command: asyncinfer chat -t 1 'hi there' (-t is a flag of asyncinfer chat, not of "
     "asyncinfer)")),
    (["--threads=1", "serve"],
     ("flags come after the command: asyncinfer serve --threads=1 (--threads is a flag of asyncinfer serve, not of "
     "asyncinfer)")),
    (["--foo", "bench"], ("flags come after the command: asyncinfer bench --foo (asyncinfer bench --help lists its "
                         "flags)")),
    (["-m", "x.gguf", "-p", "hello", "-n", "32"],
     ("-m is not a flag of asyncinfer itself: a command comes first, then its flags (asyncinfer COMMAND -m x.gguf -p "
     "hello -n 32); the commands are chat, generate, bench, info, plan, embed, lab, serve (asyncinfer --help says "
     "what each does; to start: asyncinfer chat \"Hello!\")")),
])
def test_a_commands_flag_before_the_command_is_explained(capsys, argv, message) -> None:
    """llama.cpp's ``llama-cli -m x.gguf -p hello``, typed as ``asyncinfer -m x.gguf chat``, was answered
    "'x.gguf' is not a command of asyncinfer": argparse had read the flag's value as the command."""
    assert cli_refusal(capsys, argv) == message


def test_the_top_level_flags_still_work(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("asyncinfer ")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0 and "COMMAND" in capsys.readouterr().out


# ------------------------------------------------------------------------- every flag's help and default
def test_every_flag_of_every_command_has_help_that_states_its_default() -> None:
    """The README: "``--help`` gives each flag's default". ``asyncinfer lab``'s ``--num-blocks``,
    ``--block-size``, ``--max-num-seqs``, ``--max-num-batched-tokens`` and ``--max-model-len`` had no help at all,
    and ``plan``, ``embed``, ``chat`` and ``bench`` had flags whose default was nowhere."""
    missing = []
    for name, parser in cli_commands().items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or not action.option_strings:
                continue
            if action.nargs == 0:  # an on/off switch: off unless given
                if not action.help:
                    missing.append(f"{name} {action.option_strings[0]}: no help")
                continue
            if not action.help or "default" not in action.help and "is needed" not in action.help:
                missing.append(f"{name} {action.option_strings[0]}: {action.help!r}")
    assert missing == []


def test_the_defaults_the_help_states_are_the_parsers() -> None:
    commands = cli_commands()
    lab = commands["lab"].parse_args([])
    assert (lab.num_blocks, lab.block_size, lab.max_num_seqs, lab.max_num_batched_tokens, lab.max_model_len) == (
        4096, 16, 16, 512, 4096)
    assert (lab.rate, lab.seed, lab.long_fraction, lab.priorities, lab.slo_ttft, lab.slo_tpot) == (
        0.25, 0, 0.2, (0, 2, 4), 5.0, 0.5)
    helps = {a.option_strings[0]: a.help for a in commands["lab"]._actions if a.option_strings}
    assert helps["--num-blocks"].endswith("(default: 4096)") and helps["--rate"].endswith("(default: 0.25)")
    plan = commands["plan"].parse_args([])
    assert (plan.block_size, plan.max_num_batched_tokens, plan.max_num_seqs, plan.dtype) == (16, 1024, 128, "auto")
    embed = commands["embed"].parse_args(["a"])
    assert (embed.model, embed.dtype, embed.device) == ("all-MiniLM-L6-v2", "auto", "auto")
    assert commands["embed"].parse_args(["-m", "x", "a"]).model == "x"  # -m, as on every other command


def test_embed_without_texts_names_its_argument_as_its_help_does(capsys) -> None:
    assert cli_refusal(capsys, ["embed"]) == "the following arguments are required: TEXT"
    assert "TEXT [TEXT ...]" in cli_commands()["embed"].format_usage()


# ------------------------------------------------------------------------- sampling flags in the command line's words
@pytest.mark.parametrize(("argv", "message"), [
    (["--seed", "-1"], "--seed -1 is invalid: allowed an integer in [0, 9223372036854775807]"),
    (["--top-k", "-5"], "--top-k -5 is invalid: allowed 0 or -1 (disabled), or an integer >= 1"),
    (["--presence-penalty", "9"], "--presence-penalty 9 is invalid: allowed a number in [-2, 2]"),
])
def test_a_sampling_flags_range_is_in_the_command_lines_words(capsys, argv, message) -> None:
    """``--seed -1`` said "allowed None or an int in [0, 2**63 - 1]": --seed takes no none (leaving it out is
    none), and 2**63 - 1 is Python, not a number one types."""
    assert cli.main(["chat", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"asyncinfer: error: {message}\n"


# ------------------------------------------------------------------------- generate --file -
def test_a_bad_line_on_stdin_is_named_as_stdins(capsys, monkeypatch) -> None:
    """``... | asyncinfer generate --file -`` said "- line 1: not JSON": the file's name, -, read as a stray dash."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("not json\n"))
    assert cli.main(["generate", "--file", "-"]) == 2
    assert capsys.readouterr().err.startswith("asyncinfer: error: stdin line 1: not JSON")
    monkeypatch.setattr("sys.stdin", io.StringIO("\n\n"))
    assert cli.main(["generate", "--file", "-"]) == 2
    assert capsys.readouterr().err == "asyncinfer: error: stdin: no requests in it\n"


# ------------------------------------------------------------------------- chat -c 64 without --max-tokens
def test_a_context_under_the_default_max_tokens_says_the_default_is_what_does_not_fit() -> None:
    """``asyncinfer chat -c 64 hi`` said "--max-tokens 128 is invalid" to a user who had typed no --max-tokens."""
    import asyncio

    from asyncinfer import SamplingParams
    from asyncinfer.commands.chat import ChatSession
    from asyncinfer.errors import InvalidParameterError

    class Engine:
        max_model_len = 64

    session = ChatSession(Engine(), SamplingParams(), None, max_tokens_given=False)
    with pytest.raises(InvalidParameterError) as err:
        asyncio.run(session.reply("hi"))
    assert str(err.value) == ("--max-tokens 128 (its default) is invalid: allowed less than --max-model-len (64); "
                              "give --max-tokens under 64 or raise --max-model-len")


def test_chat_tells_the_session_whether_max_tokens_was_given(monkeypatch) -> None:
    from asyncinfer.commands import chat

    seen = []

    class Stop(Exception):
        pass

    def session(*args, **kwargs):
        seen.append(kwargs["max_tokens_given"])
        raise Stop

    class Engine:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        def get_tokenizer(self):
            class Tokenizer:
                chat_template = "{{ messages }}"
            return Tokenizer()

    async def load(*args, **kwargs):
        return Engine()

    import asyncinfer.engine

    monkeypatch.setattr(asyncinfer.engine.AsyncEngine, "load", load)
    monkeypatch.setattr(chat, "ChatSession", session)
    for argv, given in ((["chat", "hi"], False), (["chat", "hi", "--max-tokens", "8"], True)):
        assert cli.main(argv) == 1  # (Stop, as an internal error, once the session was made)
        assert seen.pop() is given


# ------------------------------------------------------------------------- the model given twice
@pytest.mark.parametrize("argv", [["serve", "-m", "SmolLM2-135M-Instruct", "other"], ["info", "x", "-m", "y"],
                                  ["plan", "a", "--model", "b"], ["bench", "a", "-m", "b"],
                                  ["generate", "./a.gguf", "-m", "b", "--prompt", "hi"]])
def test_a_model_given_as_the_argument_and_as_model_is_refused(capsys, argv) -> None:
    """``asyncinfer serve -m SmolLM2-135M-Instruct other`` loaded ``other`` (the argument won, --model was dropped
    without a word) and said "model path 'other' does not exist"."""
    assert cli.main(argv) == 2
    model_arg = next(w for w in argv[1:] if not w.startswith("-") and w not in ("b", "y", "SmolLM2-135M-Instruct"))
    flag_value = argv[argv.index("-m" if "-m" in argv else "--model") + 1]
    assert capsys.readouterr().err == (
        f"asyncinfer: error: the model is given twice, as MODEL {model_arg!r} and as --model {flag_value!r}: give one "
        f"(asyncinfer {argv[0]} MODEL or asyncinfer {argv[0]} --model MODEL)\n")


def test_the_same_model_twice_is_one_model(tiny_models, capsys) -> None:
    path = str(tiny_models["llama"][0])
    assert cli.main(["info", path, "--model", path]) == 0
    assert capsys.readouterr().out.startswith("model: ")


# ------------------------------------------------------------------------- asyncinfer info | head -1
def test_output_to_a_reader_that_left_ends_quietly(tiny_models) -> None:
    """``asyncinfer info | head -1`` printed "asyncinfer: error: Broken pipe" and exited 2 once head had its line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(cli.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncinfer", "plan", str(tiny_models["llama"][0]), "--device-memory",
                             "1GiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before a line is written
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=120), err) == (141, "")  # 128 + SIGPIPE, as a shell tool's


# ------------------------------------------------------------------------- a message of several lines
class _Lines:
    """The prompt's lines, as ``_Interrupts`` reads them (with the prompt each was read at), then end of input."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = list(lines)
        self.prompts: list[str] = []

    async def read_line(self, prompt: str, editor: object) -> str | None:
        self.prompts.append(prompt)
        return self.lines.pop(0) if self.lines else None

    async def run(self, coro) -> bool:
        await coro
        return True


class _Session:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def reply(self, text: str) -> str:
        self.sent.append(text)
        return ""


async def test_a_message_of_several_lines_goes_between_triple_quotes(capsys) -> None:
    """Pasting "Summarize this:" and two lines of text sent three messages and got three replies (the first to
    "Summarize this:" alone). Between \"\"\" and \"\"\" (Ollama's convention) the lines are one message."""
    from asyncinfer.commands.chat import MORE_PROMPT, _session

    session = _Session()
    lines = _Lines(['"""Summarize this:', "The cat sat on the mat.", "", "It was happy.", '"""',
                    '"""one line"""', '"""', "  indented", 'last"""', "plain", '""""""'])
    assert await _session(session, lines, None) == 0
    assert session.sent == ["Summarize this:\nThe cat sat on the mat.\n\nIt was happy.", "one line",
                            "  indented\nlast", "plain"]
    assert lines.prompts[:5] == ["> ", MORE_PROMPT, MORE_PROMPT, MORE_PROMPT, MORE_PROMPT]
    assert capsys.readouterr().err.splitlines()[-1].startswith("(nothing sent: type a message")  # """""" is empty


async def test_an_unclosed_message_is_not_sent(capsys) -> None:
    from asyncinfer.commands.chat import _session

    session = _Session()
    assert await _session(session, _Lines(['"""', "never closed"]), None) == 0
    assert session.sent == []
    assert capsys.readouterr().err == '\n(nothing sent: the message was not closed with """)\n'


def test_help_says_how_to_send_several_lines() -> None:
    from asyncinfer.commands.chat import HELP

    assert HELP.endswith('a message of several lines goes between """ and """')


@pytest.mark.parametrize(("argv", "hint"), [
    (["help"], "for help, use asyncinfer --help (asyncinfer COMMAND --help for a command's flags)"),
    (["help", "chat"], "for help, use asyncinfer --help (asyncinfer COMMAND --help for a command's flags)"),
    (["version"], "for version, use asyncinfer --version"),
])
def test_help_and_version_typed_as_commands_name_the_flags(capsys, argv, hint) -> None:
    """``asyncinfer help`` and ``asyncinfer version`` (git's, ollama's habits) listed the commands, no word of
    --help or --version."""
    assert cli_refusal(capsys, argv).endswith(hint)


# ------------------------------------------------------------------------- lab's errors in its flags' terms
@pytest.mark.parametrize(("argv", "message"), [
    (["--rate", "0"], "--rate 0 is invalid: allowed a finite number of requests per second > 0"),
    (["--long-fraction", "2"], "--long-fraction 2 is invalid: allowed a fraction in [0, 1]"),
    (["--schedulers", "fifo,nope"], "--schedulers 'nope' is invalid: allowed one of ['aging-priority', "),  # (then
    # the names registered in this process: a plugin another test imported among them)
    (["--priorities", "a,b"], "argument --priorities: 'a,b' is not a comma-separated list of integers, e.g. 0,2,4"),
    # an empty list ran every scheduler, a name given twice ran twice: neither is what was asked for
    (["--schedulers", ""], ("--schedulers '' is invalid: allowed a comma-separated list of scheduler names, none "
                            "empty (--list-schedulers prints them)")),
    (["--schedulers", "fifo,,aging-priority"], ("--schedulers 'fifo,,aging-priority' is invalid: allowed a "
                                                "comma-separated list of scheduler names, none empty")),
    (["--schedulers", "fifo, fifo"], ("--schedulers 'fifo, fifo' is invalid: allowed each scheduler named once "
                                      "('fifo' twice)")),
])
def test_labs_errors_name_its_flags(capsys, argv, message) -> None:
    """``asyncinfer lab --rate 0`` said "rate=0.0 is invalid", ``--schedulers fifo,nope`` "scheduler='nope'",
    ``--priorities a,b`` "invalid _int_list value" (a function's name)."""
    try:
        status = cli.main(["lab", "--synthetic", "5", *argv])
    except SystemExit as exited:  # argparse's own refusal
        status = exited.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncinfer: error: {message}") and err.count("\n") == 1, err


def test_labs_files_are_named_by_their_flags(capsys, tmp_path) -> None:
    """``--trace nope.jsonl`` said "No such file or directory: nope.jsonl", a bad line "trace='t.jsonl:1' ...
    (KeyError('output_len'))"."""
    assert cli.main(["lab", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert capsys.readouterr().err == f"asyncinfer: error: --trace {tmp_path / 'nope.jsonl'}: No such file or directory\n"
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival": 0, "prompt_len": 10}\n', encoding="utf-8")
    assert cli.main(["lab", "--trace", str(trace)]) == 2
    assert capsys.readouterr().err == (
        f"asyncinfer: error: --trace {trace} line 1: expected a JSON object with arrival, prompt_len, output_len[, "
        "priority, id] (no 'output_len')\n")
    assert cli.main(["lab", "--synthetic", "5", "--cost-model", str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err == (
        f"asyncinfer: error: --cost-model {tmp_path / 'nope.json'}: No such file or directory\n")


# ------------------------------------------------------------------------- the examples' --help
@pytest.mark.parametrize("example", ["quickstart", "embeddings", "hot_swap", "structured_output"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_an_example_answers_help_with_its_usage_and_loads_nothing(example, flag) -> None:
    """``python examples/quickstart.py --help`` loaded the model and asked it "--help"; ``hot_swap.py --help`` tried
    to swap to a model named --help. (A model that does not exist is the default here: a load would fail.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "ASYNCINFER_MODEL": str(root / "no-such-model")}
    done = subprocess.run([sys.executable, str(root / "examples" / f"{example}.py"), flag], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert (done.returncode, done.stderr) == (0, "")
    assert f"python examples/{example}.py" in done.stdout  # the docstring's usage lines


# ------------------------------------------------------------------------- more of vLLM's and llama.cpp's flags
@pytest.mark.parametrize(("argv", "hint"), [
    (["serve", "--disable-log-requests"], ("vLLM's per-request logging switch; asyncinfer serve logs one line per "
                                          "request at --log-level info (the default); --log-level warning leaves "
                                          "them out")),
    (["serve", "--allowed-origins", "*"], ("vLLM's CORS setting; asyncinfer serve sends no CORS headers: a browser "
                                          "app reaches it through a proxy of the same origin, or one that adds them")),
    (["serve", "--ssl-keyfile", "k.pem"], ("a TLS setting; asyncinfer serve speaks plain HTTP: put a proxy that "
                                          "holds the certificate in front of it")),
    (["chat", "--tokenizer", "t", "hi"], ("a tokenizer of one's own; asyncinfer uses the model's own (its files "
                                         "beside the weights, or the GGUF file's)")),
    (["serve", "--jinja"], ("llama.cpp's switch to the model's own chat template; asyncinfer always uses it; drop "
                           "the flag")),
    (["serve", "-cb"], "llama.cpp's continuous batching; asyncinfer always batches continuously; drop the flag"),
])
def test_more_foreign_flags_are_refused_with_what_to_do(capsys, argv, hint) -> None:
    """``--disable-log-requests`` got "did you mean --max-waiting-requests?", ``--tokenizer`` "did you mean
    --block-size?", ``--allowed-origins *`` the shell's expansion of * as unrecognized arguments."""
    assert cli_refusal(capsys, argv) == f"{argv[1]} is not a flag of asyncinfer {argv[0]}: it is {hint}"


# ------------------------------------------------------------------------- a JSONL line's errors in JSON's words
@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens=0 is invalid: allowed an integer >= 1"),
    ('{"prompt": "x", "seed": -1}', "seed=-1 is invalid: allowed null or an integer in [0, 9223372036854775807]"),
    ('{"prompt": "x", "stop": [null]}', "stop=[null] is invalid: allowed null, a non-empty string or a list of them"),
    ('{"prompt": "x", "ignore_eos": "yes"}', 'ignore_eos="yes" is invalid: allowed a boolean (true or false)'),
    ('{"prompt": "x", "id": false}', "'id' must be a string or an integer, not false"),
    ('{"prompt": "x", "maxtokens": 3, "tmp": 1}', 'unknown key(s) "maxtokens", "tmp": the keys are prompt, messages'),
])
def test_a_jsonl_lines_values_are_shown_as_the_line_wrote_them(tmp_path, capsys, line, message) -> None:
    """A JSONL file is JSON, and its errors answered in Python: ``'id' ... not True``, ``not None``, ``unknown key(s)
    ['maxtokens']``, ``allowed None or an int in [0, 2**63 - 1]``."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n", encoding="utf-8")
    assert cli.main(["generate", str(tmp_path / "no-model"), "--file", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"asyncinfer: error: {bad} line 1: {message}")
