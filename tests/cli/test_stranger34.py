"""stranger34: a stranger's first hour arriving from Ollama / llama.cpp with their own GGUF files (make_gguf.py's
tiny files: info, plan, chat, generate, serve and an OpenAI client; refused families, truncated files, paths with
spaces, directories, the quantization names, Ctrl-C while it starts)."""

from __future__ import annotations

import signal

import pytest

from asyncinfer import grammar
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
