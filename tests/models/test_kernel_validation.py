"""The public kernel entries refuse what they cannot take before the compiled call: each input that once killed
the process (tests/models/kernel_cases.py: tensors on the meta device, a block size or KV-head count of 0,
context lengths near 2**63, rows that disagree, layers of different widths, sizes whose products overflow,
ints beyond int64 in decode_packed's list...) raises its typed error naming the parameter. Every case runs in
a forked child of one subprocess, so a crash shows as a failed case with its signal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.kernel_cases import CASES, EMPTIES, HELD

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: Path, *args: str, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": path, **env}, check=False)


@pytest.fixture(scope="module")
def outcomes() -> dict:
    proc = run_script(ROOT / "tests" / "models" / "kernel_cases.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_harness_reports_a_crash_as_its_signal(outcomes) -> None:
    assert outcomes["a real crash (the harness's own check)"] == {"signal": "SIGSEGV"}


@pytest.mark.parametrize("case", list(CASES))
def test_the_input_is_refused_by_name(outcomes, case) -> None:
    _, expected, parameter = CASES[case]
    outcome = outcomes[case]
    assert "signal" not in outcome and "exit" not in outcome, f"{case}: the process died: {outcome}"
    assert outcome.get("raised") == expected.__name__, f"{case}: {outcome}"
    assert parameter in outcome["message"], f"{case}: {outcome['message']!r} does not name {parameter!r}"


@pytest.mark.parametrize("case", list(EMPTIES))
def test_empty_inputs_give_empty_results(outcomes, case) -> None:
    assert outcomes[case] == {"returned": True}, f"{case}: {outcomes[case]}"


@pytest.mark.parametrize("case", list(HELD))
def test_a_layer_or_stack_holds_what_its_pointers_address(outcomes, case) -> None:
    """The caller's tensors replaced (``set_``) and dropped after a DecodeLayer / DecodeStack was built, or its
    layers and head rebound: the kernel still reads the weights it was built from (same result, no crash)."""
    assert outcomes[case] == {"returned": True}, f"{case}: {outcomes[case]}"


def test_hostile_calls_raise_only_typed_errors_naming_their_parameter(tmp_path) -> None:
    """tests/models/kernel_fuzz.py: Hypothesis drives every public kernel entry with hostile shapes, dtypes,
    devices and values in a subprocess (a crash shows as its signal; the log's last line names the call)."""
    log = tmp_path / "calls.log"
    proc = run_script(ROOT / "tests" / "models" / "kernel_fuzz.py", KERNEL_FUZZ_LOG=str(log),
                      KERNEL_FUZZ_EXAMPLES="300", KERNEL_FUZZ_DERANDOMIZE="1")
    last = log.read_text().splitlines()[-1:] if log.exists() else []
    assert proc.returncode == 0, (f"exit {proc.returncode} (a negative code is the signal that ended it); "
                                  f"last call {last}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def test_the_block_layout_is_written_once_and_is_ggmls() -> None:
    """formats.py's layouts are ggml's sizes (gguf.constants), and the GGUF reader's block sizes are formats'."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from asyncinfer.kernels import formats
    from asyncinfer.models import gguf_file

    for name, layout in formats.READ_LAYOUTS.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]] == (layout.weights, layout.nbytes), name
        kind = int(GGMLQuantizationType[name.upper()])
        assert gguf_file._BLOCKS[kind] == (layout.weights, layout.nbytes) and gguf_file._LAYOUTS[kind] is layout
    assert formats.BLOCK_FORMATS == {"q4_1": (32, 20), "q8_0": (32, 34)}
