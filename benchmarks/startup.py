"""Start-up: wall time and peak memory of loading a model (the default one, or ``--model PATH``), of
``asyncinfer chat`` one-shot, and of llama.cpp loading the same file.

Every measurement is a fresh Python process with the model already cached
(what a user sees from the second run on), so nothing is warm but the OS page
cache. Per round, in alternating order so that machine noise hits all alike:

- ``load``: ``import asyncinfer`` then ``AsyncEngine.from_pretrained()`` with the
  default model and options, timed inside the process (wall and CPU seconds: on a
  machine shared with other work, CPU time is the steadier figure); peak RSS of the process.
- ``chat``: ``python -m asyncinfer.cli chat "What is the capital of France?"``,
  timed from spawn to exit (interpreter, imports, load, answer); its peak RSS.
- with ``--base TREE``: the same two for another source tree (e.g. a worktree of
  the commit before a change), so before and after share the machine's noise.
- ``llama.cpp``: llama-cpp-python (when it imports; it is optional and the output says so
  plainly when it does not) loading the same GGUF file with a context as large as asyncinfer's KV
  cache, in a fresh process of its own: load seconds and peak RSS, for the issue's "load time at
  most 2x llama.cpp's on the same file".

With ``--model PATH`` (a ``.gguf`` file, e.g. from ``benchmarks/make_gguf.py``, or a model
directory) every load is of that model; ``chat`` needs a tokenizer and a chat template and is left out for a file
without one. The memory bound of loading (docs/memory.md) is checked per load: peak RSS <=
file size + KV cache + 300 MiB above the process's RSS after its imports (``baseline_rss_mib``),
and printed against the whole process's peak too.

Then one ``breakdown`` process times the phases of a load one after the other, in wall and CPU seconds
(in the engine the tokenizer loads in parallel with the weights; on a machine shared with other busy
processes the CPU seconds are the figure to compare: torch's and the kernels' OpenMP threads spin
while they wait for a core, which inflates the wall time and, less, the CPU time of the steps), and one
``cold`` process loads with an empty tokenizer cache (the first run after install,
model file already downloaded). With the default model, ``directory`` loads a model directory (a small random-weight
Llama with the default model's tokenizer: 49,152 tokens) twice in one fresh cache, in two processes: the first load
builds its tokenizer in a bounded child of a helper process it starts (docs/models_and_embeddings.md), the second
finds the verdict kept and starts none; their difference is what the bounded build costs a first load. Medians are
reported; ``--json`` writes every run.

    python benchmarks/startup.py --rounds 5 --json benchmarks/results/startup.json
    git archive 8ecfba9 | tar -x -C /tmp/before          # the tree before the start-up work
    python benchmarks/startup.py --rounds 5 --base /tmp/before --base-rounds 2 --base-label 8ecfba9
    python benchmarks/make_gguf.py /tmp/llama-1b-q4_1.gguf --shape 1b --type q4_1 --head-type q8_0
    python benchmarks/startup.py --model /tmp/llama-1b-q4_1.gguf --rounds 3 --json benchmarks/results/startup_1b.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_model, git_commit

HERE = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France?"
TARGETS = {"load_s": 5.0, "peak_rss_mib": 1536.0}

# The children's memory figures, in MiB: ``rss_mib`` now, ``peak_mib`` this process's own high-water mark
# (VmHWM starts afresh at exec; ru_maxrss keeps the forking parent's).
MEMORY = """
import os
def peak_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
"""

LOAD = MEMORY + """
import json, os, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
model = sys.argv[1] or None
t0, c0 = time.perf_counter(), cpu()
from asyncinfer import AsyncEngine
import torch  # what a load imports anyway: part of the baseline, not of the load (transformers is not, for a GGUF)
t1, c1 = time.perf_counter(), cpu()
baseline = rss_mib()
engine = AsyncEngine.from_pretrained(model)
t2, c2 = time.perf_counter(), cpu()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "load_cpu_s": c2 - c1, "baseline_rss_mib": baseline,
                  "peak_rss_mib": peak_mib(),
                  "kv_mib": engine.memory_plan.kv_bytes / 2**20, "kv_tokens": engine.memory_plan.kv_token_capacity,
                  "kv": engine.memory_plan.describe()}))
"""

LLAMA_CPP = MEMORY + """
import json, os, resource, sys, time
path, n_ctx = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
import llama_cpp
t1 = time.perf_counter()
baseline = rss_mib()
llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "baseline_rss_mib": baseline,
                  "peak_rss_mib": peak_mib(),
                  "version": getattr(llama_cpp, "__version__", "unknown")}))
"""

BREAKDOWN = MEMORY + """
import json, resource, time
from pathlib import Path
marks, cpu_marks = {}, {}
t, c = time.perf_counter(), time.process_time()
def mark(name):
    global t, c
    now, cpu = time.perf_counter(), time.process_time()
    marks[name], cpu_marks[name] = now - t, cpu - c
    t, c = now, cpu
import torch; mark("import torch")
import asyncinfer; mark("import asyncinfer (rest)")
from asyncinfer.config import EngineConfig
from asyncinfer.loading import build_core, warm_up
from asyncinfer.memory import plan_memory
from asyncinfer.model_source import resolve_model
from asyncinfer.config import for_model
from asyncinfer.models.loader import gguf_tokenizer, open_checkpoint
from asyncinfer.models.quant import WeightFormat
import sys
mark("import the loading modules")
path = resolve_model(sys.argv[1] or None); mark("resolve the model")
checkpoint = open_checkpoint(path); mark("parse and check the header")
config = for_model(EngineConfig(), {}, checkpoint.config)
plan_memory(checkpoint.config); mark("plan memory from the config")
if checkpoint.gguf is not None and "tokenizer.ggml.model" in checkpoint.gguf.fields:
    gguf_tokenizer(path)
    mark("load the cached tokenizer" + (" (transformers imported)" if "transformers" in sys.modules else ""))
loaded = checkpoint.load(config.dtype, config.device, progress=lambda done, total: None, weight_format=WeightFormat(
    config.quantization, config.quantization_skip, config.pack_weights)); mark("build the weights in their format")
plan, core = build_core(loaded, config)
mark("build the core (KV tensors)")
warm_up(core); mark("warm-up step")
print(json.dumps({"phases": marks, "phases_cpu": cpu_marks, "peak_rss_mib": peak_mib()}))
"""


def spawn(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Run ``cmd``; (wall seconds from spawn to exit, the child's peak RSS in MiB, its stdout)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read() if proc.stderr else ""
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
        out.seek(0)
        return wall, usage.ru_maxrss / 1024, out.read()


def env_for(tree: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree / "src"), "ASYNCINFER_PROGRESS": "0", **extra}


MODEL = ""  # --model: the path every load takes ("": the default model)
BOUND_MIB = 300.0  # docs/memory.md: peak RSS of a load <= file size + KV cache + 300 MiB


def run_load(tree: Path) -> dict[str, Any]:
    wall, rss, out = spawn([sys.executable, "-c", LOAD, MODEL], env_for(tree))
    record = json.loads(out.strip().splitlines()[-1])
    return {**record, "process_s": wall, "peak_rss_mib": max(rss, record["peak_rss_mib"])}


def run_chat(tree: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "asyncinfer.cli", "chat", *(["--model", MODEL] if MODEL else []), PROMPT]
    wall, rss, out = spawn(cmd, env_for(tree))
    return {"process_s": wall, "peak_rss_mib": rss, "answer": out.strip()}


def run_breakdown(tree: Path) -> dict[str, Any]:
    _, _, out = spawn([sys.executable, "-c", BREAKDOWN, MODEL], env_for(tree))
    return json.loads(out.strip().splitlines()[-1])


def run_llama_cpp(path: Path, n_ctx: int) -> dict[str, Any]:
    wall, rss, out = spawn([sys.executable, "-c", LLAMA_CPP, str(path), str(n_ctx)], dict(os.environ))
    record = json.loads(out.strip().splitlines()[-1])
    return {**record, "process_s": wall, "peak_rss_mib": max(rss, record["peak_rss_mib"])}


def llama_cpp_missing() -> str | None:
    """None when llama-cpp-python imports here, else why not."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llamacpp_peer import available

    return available()


def has_tokenizer(path: Path | None) -> bool:
    """Whether ``chat`` can run on the model: a directory, or a GGUF file with a vocabulary and a chat template."""
    if path is None or path.is_dir():
        return True
    sys.path.insert(0, str(HERE / "src"))
    from asyncinfer.models.gguf_file import GGUFFile

    fields = GGUFFile(path).fields
    return "tokenizer.ggml.model" in fields and "tokenizer.chat_template" in fields


def bound(record: dict[str, Any], file_mib: float) -> dict[str, float | bool]:
    """The load's memory against the bound: above the baseline, and the whole process."""
    limit = file_mib + record["kv_mib"] + BOUND_MIB
    above = record["peak_rss_mib"] - record["baseline_rss_mib"]
    return {"file_mib": file_mib, "limit_above_baseline_mib": limit, "peak_above_baseline_mib": above,
            "met": above <= limit}


def run_cold(tree: Path) -> dict[str, Any]:
    """A load with an empty tokenizer cache: the model file linked into a fresh cache directory."""
    sys.path.insert(0, str(tree / "src"))
    from asyncinfer.model_source import default_model_path

    model = default_model_path()
    with tempfile.TemporaryDirectory() as cache:
        target = Path(cache) / model.parent.name / model.name
        target.parent.mkdir()
        target.symlink_to(model)
        wall, rss, out = spawn([sys.executable, "-c", LOAD, ""], env_for(tree, ASYNCINFER_CACHE_DIR=cache))
    record = json.loads(out.strip().splitlines()[-1])
    return {**record, "process_s": wall, "peak_rss_mib": max(rss, record["peak_rss_mib"])}


TINY_LLAMA = """
import sys
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=int(sys.argv[2]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
"""


def run_directory(tree: Path, rounds: int) -> dict[str, Any]:
    """A model directory's first load (its tokenizer built in a bounded child of a helper started for it) and its
    second (the verdict kept: no helper), each in a fresh process, ``rounds`` times in a fresh cache each."""
    sys.path.insert(0, str(tree / "src"))
    from asyncinfer.model_source import default_model_path, tokenizer_cache_dir
    from asyncinfer.models.loader import gguf_tokenizer

    gguf = default_model_path()
    tokenizer = gguf_tokenizer(gguf)
    firsts, seconds = [], []
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(scratch) / "model"
        model.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            source = tokenizer_cache_dir(gguf) / name
            if source.exists():
                (model / name).write_bytes(source.read_bytes())
        spawn([sys.executable, "-c", TINY_LLAMA, str(model), str(len(tokenizer))], dict(os.environ))
        for i in range(rounds):
            cache = Path(scratch) / f"cache{i}"
            cache.mkdir()
            for runs in (firsts, seconds):
                wall, rss, out = spawn([sys.executable, "-c", LOAD, str(model)],
                                       env_for(tree, ASYNCINFER_CACHE_DIR=str(cache)))
                record = json.loads(out.strip().splitlines()[-1])
                runs.append({**record, "process_s": wall, "peak_rss_mib": max(rss, record["peak_rss_mib"])})
            print(f"directory round {i + 1}: first load {firsts[-1]['load_s']:.2f} s, second "
                  f"{seconds[-1]['load_s']:.2f} s", flush=True)
    return {"vocab_size": len(tokenizer), "first": firsts, "second": seconds,
            "first_median": medians(firsts), "second_median": medians(seconds),
            "bounded_build_s": statistics.median(f["load_s"] for f in firsts)
            - statistics.median(s["load_s"] for s in seconds)}


def _context_tokens(runs: dict[str, list[dict[str, Any]]]) -> int:
    """llama.cpp's context: as many tokens as asyncinfer's KV cache holds."""
    return int(runs["load"][0]["kv_tokens"]) if runs["load"] else 4096


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--base", type=Path, default=None, help="also measure this source tree (alternating)")
    p.add_argument("--base-rounds", type=int, default=None, help="rounds of the base tree (default: --rounds)")
    p.add_argument("--base-label", default=None, help="what the base tree is (e.g. its commit), for the record")
    p.add_argument("--json", type=Path, default=None, help="write every run and the medians here")
    p.add_argument("--model", type=Path, default=None,
                   help="the model every load takes: a .gguf file or a model directory (default: the default model)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even where it imports")
    args = p.parse_args()
    global MODEL
    head = HERE
    if args.model is not None:
        if not args.model.exists():
            raise SystemExit(f"--model {args.model}: no such file or directory")
        MODEL = str(args.model.resolve())
    sys.path.insert(0, str(HERE / "src"))
    from asyncinfer.model_source import resolve_model

    model_file = resolve_model(MODEL or None)
    file_mib = (model_file.stat().st_size if model_file.is_file()
                else sum(f.stat().st_size for f in model_file.glob("*.safetensors"))) / 2**20
    chat = has_tokenizer(model_file)
    peer_missing = "left out (--no-llama-cpp)" if args.no_llama_cpp else (
        "not a GGUF file" if not model_file.is_file() else llama_cpp_missing())
    runs: dict[str, list[dict[str, Any]]] = {"load": [], "chat": [], "base load": [], "base chat": [],
                                             "llama.cpp": []}
    started = loadavg()
    base_rounds = args.rounds if args.base_rounds is None else args.base_rounds
    for i in range(args.rounds):
        order: list[tuple[str, Any, Any]] = [("load", run_load, head)] + ([("chat", run_chat, head)] if chat else [])
        if args.base is not None and i < base_rounds:
            order += [("base load", run_load, args.base)] + ([("base chat", run_chat, args.base)] if chat else [])
        if peer_missing is None:
            order.append(("llama.cpp", lambda _: run_llama_cpp(model_file, _context_tokens(runs)), None))
        for name, fn, tree in (order if i % 2 == 0 else order[::-1]):
            result = fn(tree)
            runs[name].append(result)
            shown = f"load {result['load_s']:.2f} s, " if "load_s" in result else ""
            print(f"round {i + 1} {name}: {shown}process {result['process_s']:.2f} s, "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
    breakdown = run_breakdown(head)
    cold = run_cold(head) if MODEL == "" else None
    directory = run_directory(head, max(1, min(args.rounds, 3))) if MODEL == "" else None
    summary = {name: medians(r) for name, r in runs.items() if r}
    met = {k: summary["load"][k] <= limit for k, limit in TARGETS.items()}
    memory = bound(summary["load"], file_mib)
    print(f"\nmodel: {model_file} ({file_mib:.1f} MiB)")
    print("medians:")
    for name, values in summary.items():
        print(f"  {name:<10} " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    print("\nbreakdown of one load, phase by phase (wall s, CPU s of the whole process):")
    for phase, seconds in breakdown["phases"].items():
        print(f"  {seconds:6.2f} {breakdown['phases_cpu'][phase]:6.2f}  {phase}")
    if cold is not None:
        print(f"\nfirst load with an empty tokenizer cache: load {cold['load_s']:.2f} s, "
              f"peak RSS {cold['peak_rss_mib']:.0f} MiB")
    if directory is not None:
        print(f"\na model directory ({directory['vocab_size']} tokens), median load: first "
              f"{directory['first_median']['load_s']:.2f} s (its tokenizer built in a bounded child of a helper "
              f"started for it), second {directory['second_median']['load_s']:.2f} s (verdict kept, no helper): the "
              f"bounded build adds {directory['bounded_build_s']:.2f} s to a first load")
    print(f"\nmemory bound (peak RSS above the imports' <= file {file_mib:.0f} + KV {summary['load']['kv_mib']:.0f} "
          f"+ {BOUND_MIB:.0f} MiB = {memory['limit_above_baseline_mib']:.0f} MiB): "
          f"{memory['peak_above_baseline_mib']:.0f} MiB, {'met' if memory['met'] else 'NOT met'}; whole process "
          f"{summary['load']['peak_rss_mib']:.0f} MiB")
    if peer_missing is not None:
        print(f"llama.cpp: NOT MEASURED: {peer_missing} (pip install llama-cpp-python to compare with it)")
    else:
        ratio = summary["load"]["load_s"] / summary["llama.cpp"]["load_s"]
        print(f"llama.cpp {runs['llama.cpp'][0]['version']}: load {summary['llama.cpp']['load_s']:.2f} s, peak RSS "
              f"{summary['llama.cpp']['peak_rss_mib']:.0f} MiB; asyncinfer's load takes {ratio:.2f}x its time "
              f"(goal: at most 2x)")
    if MODEL == "":
        print(f"targets (load <= {TARGETS['load_s']} s, peak RSS <= {TARGETS['peak_rss_mib']:.0f} MiB): "
              f"{'met' if all(met.values()) else 'NOT met'} {met}")
    print(f"load average: {started} at the start, {loadavg()} at the end (2 cores: above 2 means contention)")
    if args.json:
        record = {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "commit": git_commit(),
            "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
                        "platform": platform.platform(), "loadavg_start": started, "loadavg_end": loadavg()},
            "base": args.base_label or (str(args.base) if args.base else None),
            "model": str(model_file), "model_mib": file_mib, "memory_bound": memory,
            "llama_cpp": peer_missing or "measured",
            "targets": TARGETS, "targets_met": met,
            "medians": summary, "runs": runs, "breakdown": breakdown, "cold_tokenizer_cache": cold,
            "directory_first_and_second_load": directory,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
