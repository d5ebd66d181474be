"""pass35: a generator's ``--scheduler-option`` given for a sentence encoder (issue 25, the first hour).

``asyncinfer serve all-MiniLM-L6-v2 --scheduler-option x=1`` (``info`` too) answered with the library's option names,
``allowed an embedding-model option: ['device', 'dtype', 'max_batch_size', ...]``, where every other generator's flag
(--max-model-len, --scheduler, ...) given for an encoder names the flags an encoder takes: the check of the error's
type came after the branch that words a refused --scheduler-option. It comes first now.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import cli


@pytest.mark.parametrize("command", ["info", "serve"])
def test_a_scheduler_option_for_a_sentence_encoder_names_the_flags_it_takes(minilm_dir: Path, capsys,
                                                                          command: str) -> None:
    argv = ["info", "--model", str(minilm_dir)] if command == "info" else ["serve", str(minilm_dir), "--port", "0"]
    assert cli.main([*argv, "--threads", "1", "--scheduler-option", "x=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.rstrip("\n") == (
        "asyncinfer: error: --scheduler-option x=1 is invalid: allowed a flag a sentence encoder takes (--dtype, "
        "--device, --threads); --scheduler-option is a text generator's")
