"""The ``asyncinfer`` subcommands that run a model: ``chat``, ``generate``, ``bench`` (``cli.py`` parses)."""

from __future__ import annotations

from asyncinfer.errors import AsyncInferError


class CommandError(AsyncInferError):
    """A command's input cannot be used (a bad JSONL line, say); the message says where and why."""
