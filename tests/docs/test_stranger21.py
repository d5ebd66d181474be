"""stranger21: docs/api.md's rows for the stats records name every field they hold."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from asyncinfer import StepStats

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _row(name: str) -> str:
    (row,) = [line for line in API.read_text().splitlines() if line.startswith(f"| `{name}` |")]
    return row


def test_step_stats_row_names_every_field() -> None:
    row = _row("StepStats")
    named = set(re.findall(r"`(\w+)`", row))
    fields = {f.name for f in dataclasses.fields(StepStats)}
    # steps, tokens, preemptions and the recent batch sizes are named in words; the rest by their field names
    assert {"scheduled_requests", "failed_steps", "idle_steps", "mask_seconds", "masked_tokens"} <= named
    assert named - {"StepStats", "step_stats"} <= fields
