"""An eighth stranger's first hour with the command line: what misled, each held to its fix."""

from __future__ import annotations

from asyncinfer.commands.bench import Row, format_rows


def _row(system: str, same: str = "") -> Row:
    return Row(system, 4, 4, 1.0, 32.8, 8.2, 0.364, 0.366, 0.041, 0.486, 0.488, same)


def test_bench_shows_the_same_tokens_column_only_when_it_compares() -> None:
    """``asyncinfer bench`` without --compare-transformers printed a "same greedy tokens" column that stayed
    empty on every row; it is there only when a row has something in it."""
    alone = format_rows([_row("asyncinfer"), _row("asyncinfer")]).splitlines()
    assert "same greedy tokens" not in alone[0] and alone[0].endswith("E2E p99")
    assert alone[2].endswith("488") and len(alone[1]) == len(alone[0])
    compared = format_rows([_row("asyncinfer"), _row("transformers", "4/4")]).splitlines()
    assert compared[0].endswith("  same greedy tokens") and compared[3].endswith("  4/4")
    assert compared[2].endswith("488")  # no trailing spaces where a row has nothing to say
