"""A ninth stranger's first hour with the command line: what misled, each held to its fix."""

from __future__ import annotations

import argparse

import pytest

from asyncinfer import cli
from asyncinfer.commands import foreign_flags
from asyncinfer.commands.chat import EMPTY_LINE, HELP, LEAVE_HINT, _session
from asyncinfer.commands.engine_flags import FLAGS


def error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    return captured.err.removeprefix("asyncinfer: error: ").rstrip("\n")


# ------------------------------------------------------------------------- generate "some text"
@pytest.mark.parametrize("argv", [["generate", "some text"], ["generate", "tell me a joke", "--max-tokens", "5"],
                                  ["generate", "hello"]])
def test_a_prompt_given_where_generate_takes_its_model_is_explained(no_load, capsys, argv) -> None:
    """``asyncinfer generate "some text"`` said "one of the arguments --prompt --file is required": the text had
    been taken for the model, and nothing said so."""
    assert cli.main(argv) == 2
    text = argv[1]
    quoted = f"'{text}'" if " " in text else text
    assert error_line(capsys) == (
        f"{text!r} was read as the model (asyncinfer generate's argument is the MODEL, a path or a name): give the "
        f"prompt with --prompt, e.g. asyncinfer generate --prompt {quoted} (or many in a JSONL file: --file FILE)")


def test_generate_without_prompts_says_where_they_go(no_load, capsys) -> None:
    assert cli.main(["generate"]) == 2
    assert error_line(capsys) == ("asyncinfer generate needs its prompts: --prompt TEXT (repeatable) or --file FILE "
                                  "(JSONL, one request a line; '-' reads stdin)")
    with pytest.raises(SystemExit) as exited:  # still one or the other (argparse's own error)
        cli.main(["generate", "--prompt", "a", "--file", "b"])
    assert exited.value.code == 2
    assert error_line(capsys) == "argument --file: not allowed with argument --prompt"


def test_a_model_path_that_does_not_exist_is_still_a_missing_model(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", "./my-model", "--prompt", "hi"]) == 2
    assert "model path 'my-model' does not exist" in error_line(capsys)


# ------------------------------------------------------------------------- chat MODEL
@pytest.mark.parametrize("given", ["HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct",
                                   "./models/missing.Q4_K_M.gguf", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_a_model_given_as_chats_prompt_is_refused_with_the_flag(no_load, capsys, given) -> None:
    """``asyncinfer chat HuggingFaceTB/SmolLM2-135M-Instruct`` sent the id to the default model as a prompt (and
    it answered); so did a .gguf name that did not exist yet."""
    assert cli.main(["chat", given]) == 2
    assert error_line(capsys) == (
        f"{given!r} is a model, not a prompt (asyncinfer chat's argument is the prompt): give it as --model "
        f"(asyncinfer chat --model {given} [PROMPT]); to send it as the prompt, give --model too")


@pytest.mark.parametrize("prompt", ["and/or", "yes/no", "24/7", "hello", "What is Qwen/Qwen2-0.5B?"])
def test_words_that_only_look_a_little_like_models_are_prompts(prompt) -> None:
    from asyncinfer.commands.chat import _looks_like_a_model

    assert _looks_like_a_model(prompt) is False


# ------------------------------------------------------------------------- vLLM's and llama.cpp's flags
def _parse(argv: list[str]) -> argparse.Namespace:
    return cli._parse(cli.build_parser(), argv)


def test_the_equivalent_flags_are_aliases() -> None:
    args = _parse(["info", "-c", "1024", "-t", "2", "-m", "x.gguf"])
    assert cli._engine_options(args) == {"max_model_len": 1024, "num_threads": 2} and args.model == "x.gguf"
    args = _parse(["serve", "--ctx-size", "512"])
    assert cli._engine_options(args) == {"max_model_len": 512}
    args = _parse(["chat", "--temp", "0.7", "hi"])
    assert args.temperature == 0.7
    by_flag = {f.flag: f for f in FLAGS}
    for flag, aliases in foreign_flags.ALIASES.items():
        assert flag in by_flag or flag in ("--model", "--temperature")
        assert not set(aliases) & set(foreign_flags.REFUSED)


@pytest.mark.parametrize(("argv", "message"), [
    (["chat", "-ngl", "99", "hi"], ("-ngl is not a flag of asyncinfer chat: it is llama.cpp's layers offloaded to the "
                                   "GPU; asyncinfer puts the whole model on one device: --device cuda (or cpu)")),
    (["info", "--ngl", "10"], ("--ngl is not a flag of asyncinfer info: it is llama.cpp's layers offloaded to the "
                               "GPU; asyncinfer puts the whole model on one device: --device cuda (or cpu)")),
    (["serve", "--n-gpu-layers=99"], ("--n-gpu-layers is not a flag of asyncinfer serve: it is llama.cpp's layers "
                                     "offloaded to the GPU; asyncinfer puts the whole model on one device: --device "
                                     "cuda (or cpu)")),
    (["serve", "--tensor-parallel-size", "2"], ("--tensor-parallel-size is not a flag of asyncinfer serve: it is "
                                               "vLLM's tensor parallelism; asyncinfer runs a model on one device "
                                               "(replicas on several: docs/scale_out.md)")),
    (["serve", "-tp", "2"], ("-tp is not a flag of asyncinfer serve: it is vLLM's tensor parallelism; asyncinfer runs "
                            "a model on one device (replicas on several: docs/scale_out.md)")),
    (["serve", "--gpu-memory-utilization", "0.9"], ("--gpu-memory-utilization is not a flag of asyncinfer serve: it "
                                                   "is vLLM's share of GPU memory; asyncinfer sizes its KV cache with "
                                                   "--kv-cache-fraction (of the memory free after the weights) or "
                                                   "--kv-cache-memory SIZE")),
    (["chat", "-n", "32", "hi"], ("-n is not a flag of asyncinfer chat: it is llama.cpp's tokens to predict; use "
                                 "--max-tokens N")),
    (["chat", "--host", "0.0.0.0"], ("--host is not a flag of asyncinfer chat: it is asyncinfer serve's (only serve "
                                    "listens: asyncinfer serve --host ADDRESS)")),
    (["serve", "--seed", "3"], ("--seed is not a flag of asyncinfer serve: it is a request's seed, which serve's "
                               "requests carry themselves; the engine's is --engine-seed SEED")),
    (["chat", "-p", "hi"], ("-p is not a flag of asyncinfer chat: it is llama.cpp's prompt; asyncinfer chat takes it "
                           "as its argument (asyncinfer chat \"TEXT\"), asyncinfer generate as --prompt TEXT")),
])
def test_the_other_flags_are_refused_with_asyncinfers_flag(no_load, capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exited:  # before argparse reads them (-tp was read as -t p)
        cli.main(argv)
    assert exited.value.code == 2
    assert error_line(capsys) == message


def test_a_commands_own_flag_is_never_refused_and_a_prompt_after_dashes_is_text() -> None:
    assert _parse(["serve", "--host", "0.0.0.0", "--port", "0"]).host == "0.0.0.0"
    assert _parse(["chat", "--seed", "3", "hi"]).seed == 3
    assert _parse(["generate", "--prompt", "hi"]).prompt == ["hi"]
    assert _parse(["chat", "--", "-n"]).prompt == ["-n"]


def test_the_refused_flags_are_no_asyncinfer_flag() -> None:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    everywhere = {f for sub in commands.values() for a in sub._actions for f in a.option_strings}
    assert not set(foreign_flags.REFUSED) & everywhere


# ------------------------------------------------------------------------- chat: an empty line
class _Lines:
    def __init__(self, lines: list[str]) -> None:
        self.lines = list(lines)

    async def read_line(self, prompt: str, editor: object) -> str | None:
        return self.lines.pop(0) if self.lines else None

    async def run(self, coro: object) -> bool:
        await coro  # type: ignore[misc]
        return True


class _Session:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def reset(self) -> None:
        pass

    async def reply(self, text: str) -> str:
        self.sent.append(text)
        return ""


async def test_an_empty_line_lists_the_commands_and_sends_nothing(capsys) -> None:
    """An Enter at the prompt did nothing at all: a new user did not learn how to leave (/exit) or start over."""
    session = _Session()
    assert await _session(session, _Lines(["", "   ", "hi", "/help"]), None) == 0
    assert session.sent == ["hi"]
    assert capsys.readouterr().err.splitlines() == [EMPTY_LINE, EMPTY_LINE, HELP]
    assert EMPTY_LINE == f"(nothing sent: type a message, or a command: {HELP})" and "/exit" in HELP


def test_a_bad_value_of_a_flag_with_aliases_names_the_flag_once(capsys) -> None:
    for argv, message in ((["info", "-c", "x"], "argument --max-model-len: 'x' is not an integer: allowed an integer >= 2"),
                          (["chat", "--temp", "hot", "hi"], ("argument --temperature: 'hot' is not a number: allowed a number in "
                                                             "[0, 10000] (0 = greedy)"))):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert error_line(capsys) == message


def test_a_text_file_of_prompts_given_to_generate_says_what_a_line_is(tmp_path, capsys) -> None:
    """``--file prompts.txt`` (one plain prompt a line) said only "not JSON (Expecting value: ...)"."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me a joke\nWhat is 2+2?\n", encoding="utf-8")
    assert cli.main(["generate", "--file", str(prompts)]) == 2
    assert error_line(capsys) == (
        f"{prompts} line 1: not JSON (Expecting value: line 1 column 1 (char 0)): each line is a JSON object such "
        'as {"prompt": "Tell me a joke"} (or a JSON string); plain prompts go on the command line as --prompt TEXT')
    prompts.write_text('{"prompt": "x",}\n', encoding="utf-8")  # broken JSON: the parser's reason alone
    assert cli.main(["generate", "--file", str(prompts)]) == 2
    assert error_line(capsys) == (f"{prompts} line 1: not JSON (Expecting property name enclosed in double quotes: "
                                  "line 1 column 16 (char 15))")


async def test_exit_without_the_slash_is_sent_then_says_how_to_leave(capsys) -> None:
    """``exit`` (as in a shell or Python's REPL) went to the model, which answered it, and the session went on
    with no word of /exit."""
    session = _Session()
    assert await _session(session, _Lines(["exit", "Quit", "exit the loop early", "/exit", "never read"]), None) == 0
    assert session.sent == ["exit", "Quit", "exit the loop early"]
    assert capsys.readouterr().err.splitlines() == [LEAVE_HINT, LEAVE_HINT]
    assert LEAVE_HINT == "(that was sent as a message; to leave, type /exit or press Ctrl-D)"


@pytest.mark.parametrize(("argv", "message"), [
    ([], ('a command is needed: chat, generate, bench, info, plan, embed, lab, serve (asyncinfer --help says what each '
         'does; to start: asyncinfer chat "Hello!")')),
    (["server"], ("'server' is not a command of asyncinfer: the commands are chat, generate, bench, info, plan, embed, "
                 "lab, serve; did you mean serve?")),
    (["run", "hi"], ("'run' is not a command of asyncinfer: the commands are chat, generate, bench, info, plan, embed, "
                    "lab, serve; for run, use asyncinfer chat (asyncinfer chat [--model MODEL] [PROMPT])")),
    (["chta", "hi"], ("'chta' is not a command of asyncinfer: the commands are chat, generate, bench, info, plan, "
                     "embed, lab, serve; did you mean chat?")),
])
def test_no_command_or_another_tools_command_says_the_way_on(capsys, argv, message) -> None:
    """``asyncinfer`` alone said "the following arguments are required: COMMAND"; ``asyncinfer run`` (ollama's)
    and ``asyncinfer server`` got argparse's list alone."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert error_line(capsys) == message


def test_the_commands_named_in_errors_are_the_parsers() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert tuple(sub.choices) == cli.COMMANDS


def test_sampling_flags_on_serve_say_that_requests_carry_them(no_load, capsys) -> None:
    """``asyncinfer serve --temperature 0.7`` (vLLM users set defaults so) was "unrecognized", and ``--max-tokens``
    got "did you mean --max-connections?"."""
    for flag in ("--temperature", "--max-tokens", "--temp"):
        with pytest.raises(SystemExit):
            cli.main(["serve", flag, "1"])
        assert error_line(capsys) == (
            f"{flag} is not a flag of asyncinfer serve: it is a request's sampling parameter: over HTTP each request "
            "sets its own in its body (max_tokens, temperature, top_p, stop, ...)")
    with pytest.raises(SystemExit):
        cli.main(["info", "--top-p", "0.9"])
    assert error_line(capsys) == ("--top-p is not a flag of asyncinfer info: it is a sampling flag of asyncinfer chat "
                                  "and asyncinfer generate")


def test_the_sampling_flags_refused_elsewhere_are_chats() -> None:
    parser = cli.build_parser()
    chat = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["chat"]
    sampling = {f for a in chat._actions for f in a.option_strings if a.dest in
                {field for _, field, _, _ in cli._SAMPLING_ARGS} | {"stop", "ignore_eos"}}
    assert sampling - {"--seed"} == set(foreign_flags.SAMPLING_FLAGS)
