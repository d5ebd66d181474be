"""stranger34: a stranger's first hour arriving from Ollama / llama.cpp with their own GGUF files (make_gguf.py's
tiny files: info, plan, chat, generate, serve and an OpenAI client; refused families, truncated files, paths with
spaces, directories, the quantization names, Ctrl-C while it starts)."""

from __future__ import annotations

import signal

import pytest

from asyncinfer import cli, grammar
from asyncinfer.commands import serve


def test_ctrl_c_while_serve_imports_the_grammar_library_is_not_lost(monkeypatch) -> None:
    """``asyncinfer serve`` imports llguidance (and transformers) for its banner's structured-output line. A Ctrl-C
    landing in ``regex``'s ``Group.__del__`` during that import was swallowed ("Exception ignored in ...
    KeyboardInterrupt") and the server loaded and served on, though README promises status 130 "even while it
    starts". The import now holds Ctrl-C back and raises it once done."""

    def import_swallowing_interrupts() -> None:
        try:  # a finalizer running during the import: Python ignores what it raises
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass

    monkeypatch.setattr(grammar, "library_missing", import_swallowing_interrupts)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        serve.structured_line()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("flag", ["--chat-template", "--chat-template-file"])
def test_chat_template_flags_from_llama_cpp_are_explained(flag: str, capsys) -> None:
    """A file without a chat template (make_gguf.py's) is refused by ``chat``; a llama.cpp user's next try,
    ``--chat-template-file t.jinja`` (llama-server's), was argparse's bare "unrecognized arguments" while
    ``--chat-template`` had a hint, which named no way on for such a file."""
    with pytest.raises(SystemExit) as exited:  # argparse's exit, before anything loads
        cli.main(["chat", "--model", "x.gguf", flag, "t.jinja", "hi"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{flag} is not a flag of asyncinfer chat" in err and "the model's own" in err
    assert "asyncinfer generate --model MODEL --prompt TEXT" in err
