"""Caller-supplied values as the built-in types they hold (plain Python, imports nothing of asyncinfer).

A subclass of ``int``, ``float`` or ``str`` may answer comparisons, ``__len__``, ``__hash__`` or ``__eq__``
with anything: checked as it comes, it passes a range it is outside of, and kept, its methods run later on the
engine thread. :func:`plain_value` reads the value through the built-in type's own method, so every check and
every table sees what the value really holds.
"""

from __future__ import annotations

from typing import Any


def plain_value(value: Any) -> Any:
    """An ``int`` (never a ``bool``), ``float`` or ``str``, of a subclass too, as the plain value it holds (the same
    object when it is one already); anything else as it is."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    return value
