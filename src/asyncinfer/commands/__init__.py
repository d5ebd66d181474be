"""The ``asyncinfer`` subcommands that run a model: ``chat``, ``generate``, ``bench`` (``cli.py`` parses)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

from asyncinfer.errors import AsyncInferError


class CommandError(AsyncInferError):
    """A command's input cannot be used (a bad JSONL line, say); the message says where and why."""


def flag_value(value: Any) -> str:
    """A flag's value in a refusal, as it would be typed: a string quoted, a whole number without argparse's
    ``.0`` (``--header-timeout 0`` was refused as ``--header-timeout 0.0``), other numbers as Python writes them."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def read_number(kind: type[int | float], allowed: str | Callable[[], str]) -> Callable[[str], Any]:
    """An argparse reader of a flag's ``kind`` of number whose range the command checks after parsing; text that is
    no such number is refused saying what the flag takes (argparse's own message was "invalid int value: 'abc'",
    no range). ``allowed``: the range in words, or a function that reads it from the library that checks it."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str) -> int | float:
        try:
            return kind(text)
        except ValueError:
            words = allowed if isinstance(allowed, str) else allowed()
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}: allowed {words}") from None

    return parse


def check_chats_render(tokenizer: Any, model: Any, command: str) -> None:
    """Refuse, once the model is loaded, a command that sends chat messages to a model that cannot render them
    (no tokenizer, or no chat template): every message would be refused, one by one (``chat`` reported each as
    not fitting max_model_len; ``generate --chat`` failed every line, exit status 1)."""
    if tokenizer is None:
        raise CommandError(f"{str(model)!r} has no tokenizer (no tokenizer files beside its weights, or none in its "
                           f"GGUF file), so {command} cannot encode messages for it")
    from asyncinfer.models.tokenizer import chat_template_of

    if chat_template_of(tokenizer) is None:
        raise CommandError(f"{str(model)!r} has no chat template, so {command} cannot render messages for it: "
                           f"send plain text with asyncinfer generate {model} --prompt TEXT")


def check_one_model(command: str, model_arg: str | None, model: str | None) -> None:
    """Refuse a model given both as the command's MODEL argument and as ``--model``, unless the same: one of them
    was silently dropped (the argument won). An empty MODEL (``asyncinfer serve "$MODEL_DIR"``, the variable unset)
    is refused as ``--model ''`` is: it was read as no MODEL, and the default model was loaded and served instead."""
    if model_arg is not None and not model_arg.strip():
        raise CommandError(f"MODEL {model_arg!r} is invalid: allowed a model directory, a .gguf file or a known name, "
                           "not an empty string (leave MODEL out for the default model; . is the working directory)")
    if model_arg is not None and model is not None and model_arg != model:
        raise CommandError(f"the model is given twice, as MODEL {model_arg!r} and as --model {model!r}: give one "
                           f"(asyncinfer {command} MODEL or asyncinfer {command} --model MODEL)")


def check_output_path(flag: str, path: str) -> None:
    """A ``--json`` / ``--plot`` path that cannot be written, refused before the command runs (minutes), not
    after it: its directory missing, not writable, or the path itself a directory."""
    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    if os.path.isdir(target):
        raise CommandError(f"{flag} {path}: Is a directory")
    if not os.path.isdir(parent):
        raise CommandError(f"{flag} {path}: No such file or directory (the directory {parent} does not exist)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(f"{flag} {path}: Permission denied (the directory {parent} is not writable)")


def plot_path(path: str) -> str:
    """The file ``--plot PATH`` writes, checked before the command runs: PATH where its suffix names a format
    matplotlib writes (``.png``, ``.svg``, ``.pdf``, ...), ``PATH.png`` where it has none (matplotlib's own
    default, which the command then names); another suffix (``out.txt``) is refused naming ``--plot`` and the
    formats (matplotlib refused it only once the run was over). Needs matplotlib installed."""
    from matplotlib.backend_bases import FigureCanvasBase

    check_output_path("--plot", path)
    suffix = os.path.splitext(path)[1]
    if not suffix:
        path += ".png"
    elif suffix[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
        formats = ", ".join(f".{ext}" for ext in sorted(FigureCanvasBase.get_supported_filetypes()))
        raise CommandError(f"--plot {flag_value(path)} is invalid: allowed a file name ending in a format matplotlib "
                           f"writes: {formats}")
    check_output_path("--plot", path)
    return path
