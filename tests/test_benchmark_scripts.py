"""The benchmark scripts still run against the engine they measure (short runs on the CPU; their
figures are not checked here, only that each finishes and writes its results file)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_make_gguf_quantizes_with_llama_cpp_or_says_it_cannot(tmp_path) -> None:
    """``--llama-quantize q4_k_m``: llama.cpp's own quantizer writes the file (its Q4_K_M mix: Q4_K with some
    tensors in Q6_K), which the engine loads in its native formats; without llama-cpp-python a clear exit."""
    model = tmp_path / "tiny-q4_k_m.gguf"
    made = run_script("make_gguf.py", str(model), "--shape", "tiny", "--llama-quantize", "q4_k_m")
    if importlib.util.find_spec("llama_cpp") is None:
        assert made.returncode != 0 and "--llama-quantize needs llama-cpp-python" in made.stderr
        assert not model.exists() and not list(tmp_path.iterdir())  # the F16 intermediate removed too
        return
    assert made.returncode == 0 and "llama.cpp q4_k_m" in made.stdout, made.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == [model.name]  # the F16 intermediate removed
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(model)).tensors}
    assert set(types.values()) == {"F32", "Q4_K", "Q6_K"} and types["output.weight"] == "Q6_K"
    from asyncinfer import AsyncEngine

    engine = AsyncEngine.from_pretrained(str(model), num_threads=1)
    assert engine.config.quantization == "native"  # "auto" keeps the file's own mix of block formats


def test_the_peer_benchmark_runs_both_engines_or_says_llama_cpp_is_missing(tmp_path) -> None:
    model, out = tmp_path / "tiny.gguf", tmp_path / "peer.json"
    made = run_script("make_gguf.py", str(model), "--shape", "tiny", "--type", "q4_0")
    assert made.returncode == 0, made.stderr[-3000:]
    done = run_script("peer.py", "--model", str(model), "--rounds", "2", "--num-requests", "3", "--min-new-tokens",
                      "2", "--max-new-tokens", "4", "--slots", "1", "3", "--decode-tokens", "4", "--repeats", "1",
                      "--probe-mib", "16", "--threads", "1", "--many-rounds", "3", "--json", str(out))
    if importlib.util.find_spec("llama_cpp") is None:
        assert done.returncode != 0 and "llama.cpp is the peer of this benchmark" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["order"] for r in result["one_request"]["rounds"]] == [["asyncinfer", "llama.cpp"],
                                                                      ["llama.cpp", "asyncinfer"]]
    assert set(result["many"]["llama_cpp_by_slots"]) == {"1", "3"} and result["workload"]["num_requests"] == 3
    assert result["many"]["asyncinfer_cache_on_off_identical"] == 3  # the prefix cache changes no token
    assert result["llama_cpp"]["system_info"] and result["weight_bytes_per_token"] > 0
    # each round held against the faster of its own two probes (before and after it), the median over the rounds
    one, per_token = result["one_request"], result["weight_bytes_per_token"]
    for r in one["rounds"]:
        assert len(r["probe_gb_s"]) == 2 and min(r["probe_gb_s"]) > 0
        assert r["asyncinfer_bandwidth_use"] == pytest.approx(r["asyncinfer"] * per_token / 1e9 / max(r["probe_gb_s"]))
    assert one["llama_cpp_bandwidth_use"] == pytest.approx(statistics.median(r["llama_cpp_bandwidth_use"]
                                                                             for r in one["rounds"]))
    assert result["read_bandwidth_gb_s"] == pytest.approx(statistics.median(max(r["probe_gb_s"]) for r in one["rounds"]))
    assert result["read_bandwidth_start_gb_s"] > 0
    # the paired rounds of the many requests: llama.cpp at the sweep's best slot count, the order alternating
    paired, many = result["many"]["paired"], result["many"]
    assert paired["llama_cpp_slots"] == many["llama_cpp_best_slots"]
    assert [r["order"][0] for r in paired["rounds"]] == ["asyncinfer", "llama.cpp", "asyncinfer"]
    for r in paired["rounds"]:
        assert r["ratio"] == pytest.approx(r["asyncinfer"] / r["llama.cpp"]) and r["llama.cpp"] > 0
    assert paired["median_ratio"] == pytest.approx(statistics.median(r["ratio"] for r in paired["rounds"]))
    assert paired["min_ratio"] == min(r["ratio"] for r in paired["rounds"])


def test_the_peer_benchmark_refuses_negative_paired_rounds_before_loading(tmp_path) -> None:
    done = run_script("peer.py", "--model", str(tmp_path / "absent.gguf"), "--many-rounds", "-1")
    assert done.returncode == 2 and "--many-rounds must be at least 0 (given -1)" in done.stderr


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


def test_the_structured_benchmark_runs(real_gguf, tmp_path) -> None:
    out = tmp_path / "structured.json"
    done = run_script("structured.py", "--model", str(real_gguf), "--num-requests", "2", "--max-tokens", "8",
                      "--rounds", "2", "--threads", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["order"][0] for r in result["rounds"]] == ["constrained", "unconstrained"]
    assert all(r["constrained"]["mask_seconds"] > 0 and r["unconstrained"]["mask_seconds"] == 0
               for r in result["rounds"])
    assert "median of 2 rounds" in done.stdout


def _revisions_module():
    spec = importlib.util.spec_from_file_location("bench_revisions", ROOT / "benchmarks" / "revisions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_workload_for_a_tokenizer_without_a_chat_template_is_the_plain_questions(monkeypatch) -> None:
    """A random-weight file of make_gguf.py has a tokenizer but no chat template: its workload's prompts are the
    questions encoded as plain text (special tokens included), not an error."""
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    assert spec is not None and spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_common", common)  # its dataclasses look their module up
    spec.loader.exec_module(common)

    class Plain:
        chat_template = None

        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [1, *map(ord, text)]}

    workload = common.build_workload(Plain(), 3, seed=0, min_new_tokens=2, max_new_tokens=4)
    assert [list(p) for p in workload.prompt_ids] == [[1, *map(ord, q)] for q in workload.questions]


def test_the_revisions_abba_design_puts_each_revision_in_each_position_equally_often() -> None:
    revisions = _revisions_module()
    two_rounds = [revisions.round_order(r, "abba") for r in range(2)]
    for position in range(4):
        assert sorted(order[position] for order in two_rounds) == ["base", "head"]
    assert all(sorted(order) == ["base", "base", "head", "head"] for order in two_rounds)
    assert [revisions.round_order(r, "ab") for r in range(2)] == [("base", "head"), ("head", "base")]


def test_the_revisions_benchmark_runs_abba_rounds(real_gguf, tmp_path) -> None:
    out = tmp_path / "revisions.json"
    done = run_script("revisions.py", "--base", ".", "--model", str(real_gguf), "--num-requests", "2",
                      "--min-new-tokens", "2", "--max-new-tokens", "4", "--decode-tokens", "8", "--repeats", "1",
                      "--rounds", "1", "--batched-repeats", "2", "--json", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [x["order"] for x in result["rounds"]] == ["base, head, head, base"]
    assert {label: len(runs) for label, runs in result["runs"].items()} == {"base": 2, "head": 2}
    assert all(len(run["walls_s"]) == 2 for runs in result["runs"].values() for run in runs)
    assert result["summary"]["tokens_identical_min"] == 2 and "CPU time a token" in done.stdout


def test_the_embedding_step_benchmark_runs(real_gguf, tmp_path) -> None:
    out = tmp_path / "embedding_step.json"
    done = run_script("embedding_step.py", "--model", str(real_gguf), "--batch", "1", "2", "--steps", "2",
                      "--rounds", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"]["same_logits"] == {"1": True, "2": True}  # the blocks' step is the float table's
    for row in result["steps"]["batches"].values():
        assert {mode: len(v) for mode, v in row["per_step_cpu_ms"].items()} == {"float32": 1, "blocks": 1,
                                                                                "torch_rows": 1}
    assert "blocks/float32" in done.stdout and "memory" not in result


def test_the_decode_split_benchmark_parts_a_step_into_the_kernels_parts(tmp_path) -> None:
    model, out = tmp_path / "tiny-q4_0.gguf", tmp_path / "split.json"
    made = run_script("make_gguf.py", str(model), "--shape", "tiny", "--type", "q4_0")
    assert made.returncode == 0, made.stderr[-3000:]
    done = run_script("decode_split.py", str(model), "--threads", "1", "--steps", "4", "--rounds", "2", "--probe-mib",
                      "16", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 2 and all(r["steps"] == 4 for r in result["rounds"])
    summary = result["summary"]
    assert 0 < summary["projections_ms"] < summary["step_ms"] and 0 < summary["projections_share"] < 1
    assert summary["weight_bytes_per_token"] > 0 and summary["probe_gb_s"] > 0
    assert summary["requests"] == 1 and 0 < summary["head_ms"] < summary["projections_ms"]
    # three requests decoding together: each step three rows
    done = run_script("decode_split.py", str(model), "--threads", "1", "--steps", "2", "--rounds", "1", "--probe-mib",
                      "16", "--requests", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["requests"] == 3 and "(3 rows a step)" in done.stdout and "MB a step (3 tokens)" in done.stdout
    assert [r["requests_decoding"] for r in result["rounds"]] == [3]  # checked after the round: none preempted
    assert summary["tokens_per_s"] == pytest.approx(3e3 / summary["step_ms"], rel=1e-9)
    for bad in ("0", "1025"):
        done = run_script("decode_split.py", str(model), "--requests", bad)
        assert done.returncode != 0 and f"--requests must be in [1, 1024], got {bad}" in done.stderr


def test_the_paged_decode_benchmark_runs(tmp_path) -> None:
    """On a CPU the kernel runs in Triton's interpreter (the script sets TRITON_INTERPRET in its own process)."""
    out = tmp_path / "paged_decode.json"
    done = run_script("paged_decode.py", "--device", "cpu", "--batch", "1", "3", "--context", "9", "--heads", "4",
                      "--kv-heads", "2", "--head-dim", "16", "--block-size", "4", "--dtype", "float32", "--warmup", "0",
                      "--iters", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(row["batch"], row["context"]) for row in result["rows"]] == [(1, 9), (3, 9)]
    assert all(row["max_abs_diff"] < 1e-5 and row["kv_bytes"] == 2 * row["batch"] * 9 * 2 * 16 * 4
               for row in result["rows"])


def test_the_decode_attention_benchmark_times_the_kernel_beside_a_baseline_library(tmp_path) -> None:
    from asyncinfer import kernels

    assert kernels.available(), kernels.unavailable_reason()
    out = tmp_path / "attention.json"
    done = run_script("decode_attention.py", "--contexts", "5", "40", "--layers", "2", "--repeats", "3", "--heads", "4",
                      "--kv-heads", "2", "--evict-mib", "1", "--threads", "1", "--baseline",
                      kernels.build_info()["path"], "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["context"] for row in result["rows"]] == [5, 40]
    for row in result["rows"]:
        assert row["kv_bytes_per_call"] == 2 * row["context"] * 2 * 64 * 4
        assert len(row["now"]["us_per_call"]) == len(row["baseline"]["us_per_call"]) == len(row["speedup"]["ratios"]) == 3
        assert row["outputs_identical"]  # the same library twice
    assert "outputs identical" in done.stdout
    done = run_script("decode_attention.py", "--heads", "6", "--kv-heads", "4")
    assert done.returncode != 0 and "--heads a multiple of --kv-heads" in done.stderr


def test_the_kquant_rows_benchmark_runs_beside_a_baseline_library(tmp_path) -> None:
    from asyncinfer import kernels

    assert kernels.available(), kernels.unavailable_reason()
    done = run_script("kquant_rows.py", "--shape", "tiny", "--layers", "1", "--repeats", "1", "--tokens", "1", "5",
                      "--baseline", kernels.build_info()["path"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith(("[now]", "[baseline]")) for line in lines) == 2
    speedups = lines[lines.index("speed-up, now over baseline (baseline time / now time)") + 2:]
    assert [line.split()[0] for line in speedups] == ["q4_1", "q4_k", "q5_k", "q6_k"]
    assert all(len(line.split()) == 3 and float(line.split()[1]) > 0 for line in speedups)
    # any block format, every pass recorded
    out = tmp_path / "rows.json"
    done = run_script("kquant_rows.py", "--shape", "tiny", "--layers", "1", "--repeats", "2", "--tokens", "1", "5",
                      "--formats", "q4_0", "q5_0", "q5_1", "q8_0", "--baseline", kernels.build_info()["path"],
                      "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    fmts = ["q4_1", "q4_0", "q5_0", "q5_1", "q8_0"]
    assert sorted((r["library"], r["format"], r["tokens"]) for r in result["passes"]) == sorted(
        (lib, fmt, m) for lib in ("now", "baseline") for fmt in fmts for m in (1, 5))
    assert all(len(r["seconds"]) == 2 and r["min_s"] <= r["median_s"] <= r["max_s"] for r in result["passes"])
    assert [(r["format"], r["tokens"]) for r in result["speedup_over_baseline"]] == [(f, m) for f in fmts for m in (1, 5)]
    assert all(len(r["ratios"]) == 2 and r["min"] <= r["median"] <= r["max"] for r in result["speedup_over_baseline"])
    assert len(result["commit"]) == 40 and result["kernel_isa"] == kernels.isa()
    assert result["activation_dtype"] == "int16"
    # the int8 rows (asyncinfer_gemm with the format's code and the int8 flag), beside the same baseline
    done = run_script("kquant_rows.py", "--shape", "tiny", "--layers", "1", "--repeats", "1", "--tokens", "1", "5",
                      "--formats", "q4_k", "q8_0", "--activation-dtype", "int8", "--baseline",
                      kernels.build_info()["path"], "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "int8 activations" in done.stdout
    result = json.loads(out.read_text())
    assert result["activation_dtype"] == "int8"
    assert [(r["format"], r["tokens"]) for r in result["speedup_over_baseline"]] == [
        (f, m) for f in ("q4_1", "q4_k", "q8_0") for m in (1, 5)]
    refused = run_script("kquant_rows.py", "--shape", "tiny", "--activation-dtype", "int4")
    assert refused.returncode == 2 and "--activation-dtype: invalid choice: 'int4'" in refused.stderr


def test_the_row_ceiling_benchmark_times_the_rows_in_cache_beside_a_baseline(tmp_path) -> None:
    from asyncinfer import kernels

    out = tmp_path / "ceiling.json"
    done = run_script("row_ceiling.py", "--formats", "q4_0", "q8_0", "--tokens", "1", "3", "--rows", "16",
                      "--width", "512", "--calls", "5", "--repeats", "2", "--activation-dtype", "int8",
                      "--baseline", kernels.build_info()["path"], "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "int8 activations" in done.stdout and "after / before" in done.stdout
    result = json.loads(out.read_text())
    assert [(r["format"], r["tokens"]) for r in result["rows"]] == [("q4_0", 1), ("q4_0", 3), ("q8_0", 1), ("q8_0", 3)]
    assert all(r["now_gb_per_s"] > 0 and r["baseline_gb_per_s"] > 0 and r["speedup"] > 0 for r in result["rows"])
    assert result["rows"][0]["weight_bytes"] == 16 * 512 // 32 * 18  # Q4_0: 18 bytes a block of 32
    assert len(result["commit"]) == 40 and result["matrix"] == [16, 512] and result["activation_dtype"] == "int8"
    refused = run_script("row_ceiling.py", "--width", "300")
    assert refused.returncode == 2 and "--width must be a positive multiple of 256" in refused.stderr


def test_the_interleaved_trial_benchmark_checks_the_layout_and_times_it_beside_the_rows_and_tile(tmp_path) -> None:
    """The trial is compiled here, its integers are the int8 rows' (its results within float rounding of theirs),
    and each of its rows is the same to the last bit alone and in the batch (the script refuses otherwise)."""
    from asyncinfer import kernels

    out = tmp_path / "trial.json"
    done = run_script("interleaved_trial.py", "--shape", "tiny", "--layers", "1", "--repeats", "2", "--tokens", "1",
                      "13", "--json", str(out))  # 13: a pass of 8 rows and a tail of 5
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted((r["kernel"], r["tokens"]) for r in result["passes"]) == sorted(
        (k, m) for k in ("rows", "tile", "trial") for m in (1, 13))
    assert all(len(r["seconds"]) == 2 and r["median_gb_per_s"] > 0 for r in result["passes"])
    assert [c["tokens"] for c in result["checks"]] == [1, 13]
    assert [c["rows_alone_equal_to_the_last_bit"] for c in result["checks"]] == [[0], list(range(13))]
    assert all(0 <= c["largest_difference_over_largest_value_vs_rows"] < 1e-5 for c in result["checks"])
    assert [r["tokens"] for r in result["ratios"]] == [1, 13] and len(result["commit"]) == 40
    isa = kernels.isa()
    assert result["trial_built_as"] == (isa if isa.startswith("avx512") else "scalar")
    assert result["trial_openmp"] is True and result["speed_comparison"] is False  # the tiny shape stays in cache
    assert "a smoke run, not a speed comparison" in done.stdout or "plain C" in done.stdout
    assert result["format"] == "q4_0" and result["trial_bytes_over_ggml"] == 1.0
    done = run_script("interleaved_trial.py", "--shape", "tiny", "--layers", "1", "--repeats", "1", "--tokens", "7",
                      "--format", "q4_k", "--json", str(out))  # Q4_K's layout, a pass of 4 rows and a tail of 3
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["format"] == "q4_k" and result["trial_bytes_over_ggml"] == 2368 / 2304
    assert [c["rows_alone_equal_to_the_last_bit"] for c in result["checks"]] == [list(range(7))]
    assert result["checks"][0]["largest_difference_over_largest_value_vs_rows"] < 1e-5
    refused = run_script("interleaved_trial.py", "--repeats", "0")
    assert refused.returncode == 2 and "must be at least 1" in refused.stderr
    refused = run_script("interleaved_trial.py", "--json", str(tmp_path))  # a directory: refused before the run
    assert refused.returncode == 2 and "checked before the run" in refused.stderr


def test_the_weight_pages_benchmark_times_the_same_rows_in_three_kinds_of_memory(tmp_path) -> None:
    out = tmp_path / "pages.json"
    done = run_script("weight_pages.py", "--shape", "tiny", "--layers", "1", "--repeats", "3", "--tokens", "1", "3",
                      "--formats", "q4_0", "q8_0", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "q4_0 (" in done.stdout and "q8_0 (" in done.stdout and "huge / small" in done.stdout
    result = json.loads(out.read_text())
    assert sorted((r["format"], r["tokens"], r["memory"]) for r in result["passes"]) == sorted(
        (f, m, kind) for f in ("q4_0", "q8_0") for m in (1, 3) for kind in ("small", "huge", "file"))
    assert all(len(r["seconds"]) == 3 and r["min_s"] <= r["median_s"] for r in result["passes"])
    assert sorted(result["weight_bytes"]) == ["q4_0", "q8_0"]
    assert all(r["best_gb_per_s"] == round(result["weight_bytes"][r["format"]] / r["min_s"] / 1e9, 3)
               for r in result["passes"])
    assert [(r["format"], r["tokens"]) for r in result["speedups"]] == [("q4_0", 1), ("q4_0", 3), ("q8_0", 1),
                                                                        ("q8_0", 3)]
    assert all(r["huge_over_small"] > 0 and r["file_over_small"] > 0 for r in result["speedups"])
    assert len(result["commit"]) == 40 and isinstance(result["huge_pages_granted"], bool)


def test_the_activation_dtype_benchmark_times_both_dtypes_of_every_format(tmp_path) -> None:
    out = tmp_path / "activation_dtype.json"
    done = run_script("activation_dtype.py", "--shape", "tiny", "--layers", "1", "--repeats", "1", "--tokens", "1", "5",
                      "--probe-mib", "16", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["tokens"]) for r in rows] == [(f, m) for f in ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")
                                                         for m in (1, 5)]
    assert all(r["int16_gb_s"] > 0 and r["int8_gb_s"] > 0 and r["bf16_gb_s"] > 0 for r in rows)


def test_the_int8_peak_benchmark_sets_the_tile_beside_the_peak_and_a_workload_s_floor(tmp_path) -> None:
    from asyncinfer import kernels

    model, peer, out = tmp_path / "tiny.gguf", tmp_path / "peer.json", tmp_path / "int8_peak.json"
    made = run_script("make_gguf.py", str(model), "--shape", "tiny", "--type", "q4_0")
    assert made.returncode == 0, made.stderr[-3000:]
    peer.write_text(json.dumps({  # the fields of a benchmarks/peer.py record the floor reads
        "workload": {"num_requests": 4, "prompt_tokens": 100, "output_tokens": 20},
        "many": {"llama_cpp_best_slots": 16, "llama_cpp_by_slots": {"16": {"wall_s": 3.0}},
                 "asyncinfer_prefix_cache_off_tokens_per_s": 10.0}}))
    done = run_script("int8_peak.py", "--shape", "tiny", "--formats", "q4_0", "q4_k", "--tokens", "16", "--repeats",
                      "1", "--iterations", "1000000", "--peer-json", str(peer), "--model", str(model), "--json", str(out))
    too_few = run_script("int8_peak.py", "--shape", "tiny", "--iterations", "10")
    assert too_few.returncode != 0 and "--iterations must be at least 1,000,000, got 10" in too_few.stderr
    if kernels.isa() not in ("avx512", "avx512vnni"):  # the tile runs on the AVX-512 builds only
        assert done.returncode != 0 and f"this machine's is {kernels.isa()}" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    peak = result["peak"]["macs_per_s"]
    assert peak > 0 and result["peak"]["best_chains"] in (8, 12, 16)
    assert [(r["format"], r["tokens"]) for r in result["tile"]] == [("q4_0", 16), ("q4_k", 16)]
    assert all(r["share_of_peak"] == r["macs_per_s"] / peak for r in result["tile"])
    floor = result["floor"]
    layers, head = floor["macs_per_token"]["layers"], floor["macs_per_token"]["head"]
    assert layers > head > 0  # the tiny shape's layers outweigh its head
    assert floor["prefill_macs"] == 100 * layers + 4 * head and floor["decode_macs"] == 16 * (layers + head)
    assert floor["floor_s"] == (floor["prefill_macs"] + floor["decode_macs"]) / (peak * 2)
    assert floor["most_ahead_of_llama_cpp"] == 3.0 / floor["floor_s"]
    assert floor["share_of_peak_the_target_needs"] == floor["floor_s"] / 1.5
    assert floor["asyncinfer_cache_off_share_of_peak"] == floor["floor_s"] / 2.0


def test_the_waiting_queue_benchmark_times_a_neighbour_beside_each_queue_length(tmp_path) -> None:
    out = tmp_path / "waiting_queue.json"
    done = run_script("waiting_queue.py", "--waiting", "0", "300", "--policies", "fifo", "aging-priority",
                      "--rounds", "1", "--window", "0.2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(out.read_text())["neighbour_tpot_ms"]
    assert set(table) == {"fifo", "aging-priority"} and all(set(t) == {"0", "300"} for t in table.values())
    assert all(v["tpot_ms"] > 0 for t in table.values() for v in t.values())
    refused = run_script("waiting_queue.py", "--window", "0")
    assert refused.returncode == 2 and "--window must be > 0" in refused.stderr


@pytest.mark.parametrize("flag", ["--hidden", "--layers", "--intermediate", "--heads", "--kv-heads", "--vocab-size"])
def test_make_gguf_refuses_a_shape_override_of_zero(tmp_path, flag) -> None:
    """An override of 0 is refused as any non-positive one: it was read as 'not given' and the shape's own
    value written (``--layers 0`` made the 2-layer tiny file, exit status 0)."""
    model = tmp_path / "zero.gguf"
    made = run_script("make_gguf.py", str(model), "--shape", "tiny", flag, "0", timeout=60)
    assert made.returncode == 1 and made.stderr.strip() == f"{flag} must be positive, got 0", made.stderr
    assert not model.exists()
