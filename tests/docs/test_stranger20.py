"""docs/scale_out.md's measured table: it says which weight format it was measured with, and today's default."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_ray_table_says_it_was_measured_with_the_old_float32_default() -> None:
    """The table's 515 MiB of float32 weights per replica is not what examples/ray_serve.py loads now (the default
    model's own Q4_1 blocks, 92.1 MiB, the figure docs/formats.md and `asyncinfer plan` give)."""
    text = " ".join((ROOT / "docs" / "scale_out.md").read_text().split())
    assert "The same command now loads the model's own Q4_1 blocks (92.1 MiB of weights" in text
    assert "(515 MiB for this model in float32, as measured; 92.1 MiB in today's default Q4_1)" in text
    assert "92.1 MiB" in (ROOT / "docs" / "formats.md").read_text()
