"""The grid of step shapes that ``asyncinfer lab --calibrate`` times: plain data, no model.

The timing itself (``time_cases``) and the calibration (``calibrate``: build an engine,
time its runner on these shapes, fit :class:`~asyncinfer.lab.cost.StepCostModel`) run
the model, so they are in :mod:`asyncinfer.commands.calibrate`, above the engine: the
lab never imports the engine (importing them from here still works, with a ``DeprecationWarning`` naming the new place).
"""

from __future__ import annotations

import importlib
import platform
import warnings
from typing import Any

#: A step to time: ``(num_computed_tokens, num_new_tokens, num_tokens)`` per request.
Case = list[tuple[int, int, int]]


def _decodes(batch: int, context: int) -> Case:
    return [(context - 1, 1, context)] * batch


def _chunk(query: int, prior: int = 0, last: bool = True) -> Case:
    return [(prior, query, prior + query + (0 if last else 1))]


def default_cases(max_context: int = 2048) -> list[Case]:
    """Decode batches of 1-64 at short and long contexts, prompt chunks of 16-512 tokens, mixes."""
    long = min(max_context, 2000)
    cases: list[Case] = []
    for batch in (1, 4, 16, 32, 64):
        for context in (128, min(1024, long)):
            cases.append(_decodes(batch, context))
    cases.append(_decodes(8, long))
    cases += [_chunk(q) for q in (16, 64, 256, 512)]
    cases += [_chunk(256, prior=min(512, long - 256), last=False), _chunk(128, prior=long - 128)]
    cases += [_chunk(32) * 4, _chunk(16) * 8]
    cases += [_decodes(16, 512) + _chunk(128), _decodes(32, 256) + _chunk(256, last=False)]
    return cases


#: The names that run the model, and where they are.
_MOVED = ("calibrate", "time_cases")


def __getattr__(name: str) -> Any:
    """The old names stay importable from here, resolved on first access (so importing the lab never imports the
    engine), with a DeprecationWarning naming the new place."""
    if name in _MOVED:
        warnings.warn(f"asyncinfer.lab.calibrate.{name} moved to asyncinfer.commands.calibrate (the lab never "
                      f"imports the engine): use 'from asyncinfer.commands.calibrate import {name}'",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("asyncinfer.commands.calibrate"), name)
    raise AttributeError(f"module 'asyncinfer.lab.calibrate' has no attribute {name!r}")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's, else what the platform module says), for a calibration's or a
    benchmark's record."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
