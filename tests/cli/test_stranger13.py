"""A thirteenth stranger's first hour with a model of their own on the command line: what misled, each held to
its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import cli
from tests.helpers import REPO_ROOT, load_script


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("asyncinfer: error: ").rstrip("\n")


@pytest.fixture
def gguf_here(tmp_path: Path, monkeypatch) -> Path:
    """A working directory holding ``tiny.gguf`` (a file that is never read: every refusal here comes first)."""
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_missing_model_beside_prompts_is_not_taken_for_a_prompt(gguf_here: Path, capsys) -> None:
    """``asyncinfer generate tiny_model --prompt hi`` (the file is tiny_model.gguf) said "'tiny_model' was read as the
    model ... give the prompt with --prompt, e.g. asyncinfer generate --prompt tiny_model": the prompt was given, the
    model path was mistyped. With --prompt or --file given, MODEL is a model, and a missing one "does not exist"."""
    assert cli.main(["generate", "nothing_here", "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert _error_line(capsys) == (
        "loading 'nothing_here' failed: model path 'nothing_here' does not exist (expected a Hugging Face model "
        "directory with config.json and *.safetensors, a .gguf file, or a known name: 'SmolLM2-135M-Instruct', "
        "'all-MiniLM-L6-v2'; model hubs are not contacted)")


@pytest.mark.parametrize("given", ["tiny", "tiny.GGUF", "./tiny"])
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["info"], ["plan"]])
def test_a_gguf_named_without_its_suffix_is_pointed_at(gguf_here: Path, capsys, given: str, command: list[str]) -> None:
    """``asyncinfer info tiny`` beside ``tiny.gguf`` listed what a model may be; the file it meant was there."""
    argv = [command[0], given, *command[1:]]
    assert cli.main(argv) == 2
    shown = str(Path(given))
    near = str(Path(given).with_name("tiny.gguf"))
    loading = f"loading {given!r} failed: " if command[0] == "generate" else ""
    assert _error_line(capsys) == f"{loading}model path {shown!r} does not exist (did you mean {near!r}?)"


def test_serve_says_a_model_that_does_not_load_in_one_line(tmp_path: Path, capfd) -> None:
    """``asyncinfer serve DIR`` whose directory has a config.json but no weights (or a truncated shard, or no
    tokenizer.json) printed the load's whole traceback through uvicorn's lifespan and exited 3, where every other
    command says its error in one line with status 2 (``asyncinfer --help``)."""
    from tests.helpers import tiny_hf_config

    tiny_hf_config("qwen3").save_pretrained(tmp_path)
    assert cli.main(["serve", str(tmp_path), "--port", "0", "--log-level", "warning"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == f"asyncinfer: error: loading {str(tmp_path)!r} failed: no *.safetensors weights in {tmp_path}"


def _peer(monkeypatch):
    return load_script(monkeypatch, REPO_ROOT / "benchmarks" / "peer.py", "peer_under_test"), REPO_ROOT


def test_the_peer_benchmark_s_documented_smoke_run_passes_its_own_checks(monkeypatch) -> None:
    """benchmarks/README.md's smoke run of peer.py (``--max-new-tokens 8`` without ``--min-new-tokens``) stopped at
    once: "need ... 1 <= --min-new-tokens <= --max-new-tokens", the default minimum being 32."""
    import re
    import shlex

    peer, root = _peer(monkeypatch)
    text = (root / "benchmarks" / "README.md").read_text()
    (command,) = re.findall(r"A smoke run: `python benchmarks/peer\.py ([^`]*)`", text)
    ran = []
    monkeypatch.setattr(peer, "run", lambda args: ran.append(args) or {})
    monkeypatch.setattr(peer, "report", lambda record: None)
    assert peer.main(shlex.split(command.replace("FILE", "tiny.gguf"))) == 0
    assert (ran[0].min_new_tokens, ran[0].max_new_tokens, ran[0].decode_tokens) == (4, 8, 8)


def test_the_peer_benchmark_names_the_lengths_it_refuses(monkeypatch, capsys) -> None:
    peer, _root = _peer(monkeypatch)
    with pytest.raises(SystemExit):
        peer.main(["--model", "tiny.gguf", "--max-new-tokens", "8"])
    assert capsys.readouterr().err.splitlines()[-1].split(": ", 1)[1] == (
        "error: need 1 <= --min-new-tokens <= --max-new-tokens (given --min-new-tokens 32, "
        "--max-new-tokens 8; the defaults are 32 and 128)")


@pytest.mark.parametrize(("argv", "said"), [
    (["chat", "tiny.gguf", "hi there"], "asyncinfer chat --model tiny.gguf 'hi there'"),
    (["chat", "tiny.gguf", "hi", "there"], "asyncinfer chat --model tiny.gguf hi there"),
    (["chat", "SmolLM2-135M-Instruct", "hi"], "asyncinfer chat --model SmolLM2-135M-Instruct hi"),
])
def test_chat_refuses_a_model_given_before_its_prompt(gguf_here: Path, capsys, monkeypatch, argv, said) -> None:
    """``asyncinfer chat my.gguf "hi"`` (MODEL first, as serve and generate take it) loaded the default model and sent
    it "my.gguf hi": only a one-word prompt that named a model was refused. The first of several words that surely
    names one (a .gguf, a model directory, a known name) is refused the same way, before any load."""
    import asyncinfer.engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(asyncinfer.engine.AsyncEngine, "load", no_load)
    monkeypatch.setattr(asyncinfer.engine.AsyncEngine, "from_pretrained", no_load)
    assert cli.main(argv) == 2
    assert _error_line(capsys) == (
        f"{argv[1]!r} is a model, not a prompt (asyncinfer chat's argument is the prompt): give it as --model "
        f"({said}); to send it as the prompt, give --model too")


def test_chat_still_takes_a_sentence_that_starts_with_a_path_like_word(gguf_here: Path) -> None:
    from asyncinfer.commands.chat import _names_a_model

    assert not _names_a_model("TCP/IP-based")  # a Hub-id-shaped word starts sentences: only files and known names
    assert not _names_a_model("tiny")  # no such file: tiny.gguf is the file
    assert _names_a_model("tiny.gguf") and _names_a_model("./tiny.gguf")


def test_generate_gives_the_token_ids_of_a_model_without_a_tokenizer(tmp_path: Path, capsys) -> None:
    """A model without a tokenizer takes token-id prompts, and its output lines held ``"text": ""`` and the counts
    only: what it generated was nowhere. Its lines carry ``token_ids`` (greedy: the same ids each run)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    model = tmp_path / "ids.gguf"
    made = subprocess.run([sys.executable, str(root / "benchmarks" / "make_gguf.py"), str(model), "--shape", "tiny",
                           "--vocab", "none", "--type", "q8_0", "--direct-blocks"], check=False, capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": [1, 2, 3], "max_tokens": 3}) + "\n")
    runs = []
    for _ in range(2):
        assert cli.main(["generate", str(model), "--file", str(prompts), "--no-progress"]) == 0
        (line,) = capsys.readouterr().out.splitlines()
        runs.append(json.loads(line))
    first = runs[0]
    assert {k: first[k] for k in ("id", "text", "finish_reason", "prompt_tokens", "completion_tokens")} == {
        "id": 0, "text": "", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 3}
    assert len(first["token_ids"]) == 3 and all(0 <= t < 1024 for t in first["token_ids"])
    assert runs[1]["token_ids"] == first["token_ids"]
