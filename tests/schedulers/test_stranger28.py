"""benchmarks/scheduler_lab.py on a user's model: one line, not a traceback, where the trace or the options do
not fit it (stranger28).

``--model`` of a 512-token context with the default ``--max-model-len 1024`` ended in the engine's
``InvalidParameterError`` traceback; with ``--max-model-len 512``, in another one from the first request of the
default trace (a 720-token prompt), after the model was loaded.
"""

from __future__ import annotations

import pytest

from tests.helpers import REPO_ROOT, load_script

ARGS = ["--requests", "6", "--policies", "fifo", "--threads", "1"]


@pytest.fixture
def lab(monkeypatch):
    return load_script(monkeypatch, REPO_ROOT / "benchmarks" / "scheduler_lab.py", "stranger28_scheduler_lab")


def test_a_trace_prompt_past_max_model_len_is_one_line(lab, tiny_models) -> None:
    with pytest.raises(SystemExit, match=r"request 'r0' of the trace has a 720-token prompt, which --max-model-len "
                                         r"512 does not hold"):
        lab.main(["--model", str(tiny_models["llama"][0]), "--max-model-len", "512", *ARGS])


def test_a_max_model_len_past_the_model_context_is_one_line(lab, tiny_models) -> None:
    with pytest.raises(SystemExit, match=r"scheduler_lab.py: max_model_len=1024 is invalid: allowed at most the "
                                         r"model's context length 512"):
        lab.main(["--model", str(tiny_models["llama"][0]), *ARGS])
