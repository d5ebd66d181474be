"""The benchmark scripts still run against the engine they measure (short runs on the CPU; their
figures are not checked here, only that each finishes and writes its results file)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_the_embedding_benchmark_runs(minilm_dir, tmp_path) -> None:
    out = tmp_path / "embeddings.json"
    done = run_script("embeddings.py", "--model", str(minilm_dir), "--concurrency", "1", "4", "--requests", "32",
                      "--settings", "on", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(row["setting"], row["concurrency"], row["calls"]) for row in result["rows"]] == [("on", 1, 32),
                                                                                              ("on", 4, 32)]
    assert len(result["batch_cost"]) == 6 and "one forward pass" in done.stdout


def test_the_threads_benchmark_runs(real_gguf, tmp_path) -> None:
    out = tmp_path / "threads.json"
    done = run_script("threads.py", "--model", str(real_gguf), "--rounds", "2", "--decode-tokens", "4",
                      "--batch", "2", "--batch-tokens", "4", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {case: len(f["decode"]) for case, f in result["rounds"].items()} == {"clean": 2, "other_team": 2}
    assert set(result["clean_over_other_team"]) == {"decode", "batch"} and "medians:" in done.stdout


def test_the_startup_benchmark_loads_a_generated_file_and_says_whether_llama_cpp_ran(tmp_path) -> None:
    model, out = tmp_path / "tiny.gguf", tmp_path / "startup.json"
    peer = importlib.util.find_spec("llama_cpp") is not None
    # llama.cpp loads only a file with a vocabulary; without llama.cpp, a file without one (so no chat run).
    made = run_script("make_gguf.py", str(model), "--shape", "tiny", "--type", "q4_1", "--head-type", "q8_0",
                      "--vocab", "spm" if peer else "none")
    assert made.returncode == 0 and "wrote" in made.stdout, made.stderr[-3000:]
    done = run_script("startup.py", "--model", str(model), "--rounds", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["runs"]["load"]) == 1
    assert not result["runs"]["chat"]  # no tokenizer or no chat template in the file: no chat run
    assert result["memory_bound"]["met"] and result["model_mib"] < 2
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert result["llama_cpp"].startswith("ModuleNotFoundError") and "llama.cpp: NOT MEASURED" in done.stdout
    else:
        assert result["llama_cpp"] == "measured" and len(result["runs"]["llama.cpp"]) == 1


def test_the_structured_masks_benchmark_runs(real_gguf, tmp_path) -> None:
    out = tmp_path / "structured_masks.json"
    done = run_script("structured_masks.py", "--model", str(real_gguf), "--rounds", "1", "--grammars", "person",
                      "choice", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("llguidance", "xgrammar"):  # measured where installed, else why not
        lib = result["libraries"][name]
        if isinstance(lib, str):
            assert lib.startswith("ModuleNotFoundError") and f"{name}: NOT MEASURED" in done.stdout
        else:
            assert set(lib["grammars"]) == {"person", "choice"} and lib["grammars"]["person"]["tokens"] > 5
    assert isinstance(result["libraries"]["llguidance"], dict)  # the engine's library: a dev dependency
    assert {"numpy_unpackbits_1", "numpy_unpackbits_32"} <= set(result["apply_us"])
