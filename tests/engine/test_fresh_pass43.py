"""pass43: a path or a prompt starting with ``~`` and a name that is no user's.

``Path.expanduser()`` raises ``RuntimeError("Could not determine home directory.")`` for ``~NAME`` where no user
NAME exists, where ``os.path.expanduser`` leaves it as it is. A model path mistyped without its slash
(``--model ~models/my.gguf`` for ``~/models/my.gguf``) was "asyncinfer: internal error: RuntimeError" from chat,
generate, info and serve, a RuntimeError traceback from the benchmark scripts (and ``AsyncEngine.load`` raised it,
not a ``ModelLoadError``); and so was a prompt of one word that starts with ``~`` (``asyncinfer chat "~hey"``, read
for whether it names a model file). Such a path is now what it says, a path that does not exist, and such a prompt
a prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, ModelLoadError, cli
from asyncinfer.commands import chat, generate
from asyncinfer.model_source import resolve_model
from tests.helpers import ENGINE_BASE, load_script

NO_USER = "~no-such-user-pass43"


def test_a_model_path_under_no_users_home_does_not_exist() -> None:
    with pytest.raises(ModelLoadError, match=f"model path '{NO_USER}/my.gguf' does not exist"):
        resolve_model(f"{NO_USER}/my.gguf")


async def test_the_engine_refuses_it_as_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        await AsyncEngine.load(f"{NO_USER}/my.gguf", **ENGINE_BASE)


@pytest.mark.parametrize("argv", [["info", f"{NO_USER}/my.gguf"],
                                  ["chat", "--model", f"{NO_USER}/my.gguf", "--threads", "1", "hi"],
                                  ["generate", "--model", f"{NO_USER}/my.gguf", "--threads", "1", "--prompt", "hi"]])
def test_the_cli_says_it_does_not_exist(capsys, argv: list[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("asyncinfer: error: ") and "does not exist" in err, err


def test_a_one_word_prompt_starting_with_a_tilde_is_a_prompt() -> None:
    assert not chat._looks_like_a_model(NO_USER)
    assert not chat._names_a_model(NO_USER)
    assert generate._reads_as_a_prompt(NO_USER)


def test_the_benchmarks_say_it_does_not_exist(monkeypatch) -> None:
    common = load_script(monkeypatch, Path(__file__).parents[2] / "benchmarks" / "common.py", "bench_common")
    with pytest.raises(SystemExit, match="does not exist"):
        common.resolve_model_path(f"{NO_USER}/my.gguf")
