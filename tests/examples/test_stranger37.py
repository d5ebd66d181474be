"""A stranger's first hour (stranger37): ``--threads 1`` given to an example.

Every ``asyncinfer`` command takes ``--threads``, and docs/formats.md tells a shared machine to use one thread;
``python examples/embeddings.py --threads 1`` loaded both models, then answered the questions "--threads" and "1"
(and quickstart.py the question "--threads 1", structured_output.py two messages; hot_swap.py swapped to a model
'--threads', refused after the first load). Such a flag is now refused in one line, status 2, before anything
loads, naming OMP_NUM_THREADS (what the docs' example runs set)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("example", "takes"), [("quickstart", "a question"), ("structured_output", "messages"),
                                                ("embeddings", "questions"), ("hot_swap", "a model to swap to")])
def test_a_flag_is_not_read_as_the_examples_input(example, takes) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / f"{example}.py"), "--threads", "1"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-2000:])
    assert proc.stdout == ""  # nothing asked, swapped or loaded
    assert proc.stderr == (f"{example}.py: error: unrecognized argument '--threads': this example takes {takes} only "
                           "(set OMP_NUM_THREADS=1 for one thread; --help for the usage)\n")
