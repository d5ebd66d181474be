"""Progress lines for long loads, on a terminal only.

A library must not litter a server's logs, so nothing is written unless stderr
is a terminal, and ``ASYNCINFER_PROGRESS=0`` silences even that. A line appears
only once the work has run for :data:`DELAY` seconds: a load that takes a
second prints nothing.
"""

from __future__ import annotations

import os
import sys
import time

DELAY = 1.0


def enabled() -> bool:
    """True when progress may be shown: stderr is a terminal and ``ASYNCINFER_PROGRESS`` is not "0"."""
    return os.environ.get("ASYNCINFER_PROGRESS", "1") != "0" and sys.stderr.isatty()


def say(message: str) -> None:
    """One ``[asyncinfer] message`` line on stderr, when :func:`enabled`."""
    if enabled():
        print(f"[asyncinfer] {message}", file=sys.stderr, flush=True)


class TerminalProgress:
    """``progress(done, total)``: a one-line ``label: 42% (done/total unit)`` that rewrites itself."""

    def __init__(self, label: str, unit: str = "") -> None:
        self.label = label
        self.unit = f" {unit}" if unit else ""
        self.start = time.monotonic()
        self.shown = False
        self.on = enabled()

    def __call__(self, done: int, total: int) -> None:
        if not self.on or (not self.shown and time.monotonic() - self.start < DELAY):
            return
        self.shown = True
        pct = 100 * done // max(total, 1)
        end = "\n" if done >= total else ""
        print(f"\r[asyncinfer] {self.label}: {pct:3d}% ({done}/{total}{self.unit})", end=end, file=sys.stderr,
              flush=True)
