"""The benchmark scripts still run against the engine they measure (short runs on the CPU; their
figures are not checked here, only that each finishes and writes its results file)."""

from __future__ import annotations

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
