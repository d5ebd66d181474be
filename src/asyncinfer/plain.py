"""Caller-supplied values as the built-in types they hold (plain Python, imports nothing of asyncinfer).

A subclass of ``int``, ``float`` or ``str`` may answer comparisons, ``__len__``, ``__hash__`` or ``__eq__``
with anything: checked as it comes, it passes a range it is outside of, and kept, its methods run later on the
engine thread. :func:`plain_value` reads the value through the built-in type's own method, so every check and
every table sees what the value really holds. :func:`logged` shows such a value in a log line.
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


def logged(value: Any) -> Any:
    """``value`` as a log line shows it: a text holding a space, a line break or another character that is not
    printable (or an empty one) as its ``repr``, quoted and escaped, so that a name or id a caller chose cannot end
    the line and write another one, posing as another request's; anything else as it is. Read as the plain value it
    holds (:func:`plain_value`): a subclass's own ``isprintable``, ``in`` or ``__str__`` passed a line break as a
    clean text, and ``%s`` wrote what its ``__str__`` chose (pass41)."""
    value = plain_value(value)
    if isinstance(value, str) and (not value.isprintable() or " " in value or not value):
        return repr(value)
    return value
