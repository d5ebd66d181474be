"""A forty-fourth stranger's first hour with the command line and the scheduler plugins: what misled, each held
to its fix."""

from __future__ import annotations

import pytest

from asyncinfer import cli


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


@pytest.mark.parametrize(("module", "dotted", "where"), [
    ("examples/custom_scheduler.py", "examples.custom_scheduler", "examples"),
    ("./examples/custom_scheduler.py", "examples.custom_scheduler", "examples"),
    ("examples\\custom_scheduler", "examples.custom_scheduler", "examples"),
    ("s44_no_such_policies.py", "s44_no_such_policies", "it"),
])
def test_lab_plugin_given_as_a_file_names_the_dotted_module(capsys, module: str, dotted: str, where: str) -> None:
    """``asyncinfer lab --plugin examples/custom_scheduler.py``, the example's file as a shell completes it, said
    ``No module named 'examples/custom_scheduler'`` (a leading ``./``: "an absolute module name"), where
    ``--scheduler`` given a file's path shows the dotted name it means."""
    assert cli.main(["lab", "--plugin", module, "--list-schedulers"]) == 2
    assert _error_line(capsys) == (
        f"asyncinfer: error: --plugin {module!r} is invalid: allowed an importable module: a module's dotted name, "
        f"not a file's path (here {dotted}, run from the directory that holds {where})")


def test_lab_num_blocks_too_few_for_one_request_names_the_flags(capsys, tmp_path) -> None:
    """``asyncinfer lab --num-blocks 1`` said ``1 blocks of 16 cannot hold one max_model_len=4096 request``, no flag
    named, after writing the ``--save-trace`` file; it is refused in the flags' terms before anything is written."""
    saved = tmp_path / "t.jsonl"
    assert cli.main(["lab", "--synthetic", "5", "--num-blocks", "255", "--save-trace", str(saved)]) == 2
    assert _error_line(capsys) == (
        "asyncinfer: error: --num-blocks 255 is invalid: allowed at least 256, the blocks of --block-size 16 tokens "
        "that one --max-model-len 4096 request needs (or lower --max-model-len)")
    assert not saved.exists()
    assert cli.main(["lab", "--synthetic", "5", "--num-blocks", "8", "--block-size", "4", "--max-model-len", "33"]) == 2
    assert _error_line(capsys).endswith("--num-blocks 8 is invalid: allowed at least 9, the blocks of --block-size 4 "
                                        "tokens that one --max-model-len 33 request needs (or lower --max-model-len)")
    assert cli.main(["lab", "--synthetic", "5", "--num-blocks", "9", "--block-size", "4", "--max-model-len", "33",
                     "--schedulers", "fifo"]) == 0


def test_embed_one_text_says_there_is_no_similarity_to_show(minilm_dir, capsys) -> None:
    """``asyncinfer embed "a"`` printed the header ``cosine similarity:`` over a row with no similarity."""
    assert cli.main(["embed", "--model", str(minilm_dir), "--device", "cpu", "--threads", "1", "a"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "embedding (one text: no similarity to show):"
    assert len(lines) == 3 and lines[2].startswith("  a  [") and lines[2].endswith(" ...]")


def test_embed_labels_every_text_on_one_line(minilm_dir, capsys) -> None:
    """A text with a line break broke the table in two rows; such texts are quoted (and one padded with spaces), and
    a long one is cut to 60 characters with an ellipsis. (An empty text is refused before the load:
    tests/cli/test_generate_empty_prompt.py.)"""
    texts = ["two\nlines", " pad", "x" * 80, "b"]
    assert cli.main(["embed", "--model", str(minilm_dir), "--device", "cpu", "--threads", "1", *texts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "cosine similarity:"
    rows = lines[2:]
    assert len(rows) == len(texts)
    labels = [row[2:].split("  [", 1)[0].rstrip() for row in rows]
    assert labels == ["'two\\nlines'", "' pad'", "x" * 59 + "…", "b"]
    assert len({row.index("[") for row in rows}) == 1   # one column for the vectors
    assert all(row.endswith("1.00") or " 1.00 " in row for row in rows)
