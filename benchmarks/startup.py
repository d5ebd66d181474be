"""Start-up: wall time and peak memory of loading the default model, and of ``asyncinfer chat`` one-shot.

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

Then one ``breakdown`` process times the phases of a load one after the other
(in the engine the tokenizer loads in parallel with the weights), and one
``cold`` process loads with an empty tokenizer cache (the first run after install,
model file already downloaded). Medians are reported; ``--json`` writes every run.

    python benchmarks/startup.py --rounds 5 --json benchmarks/results/startup.json
    git archive 8ecfba9 | tar -x -C /tmp/before          # the tree before the start-up work
    python benchmarks/startup.py --rounds 5 --base /tmp/before --base-rounds 2 --base-label 8ecfba9
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

HERE = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France?"
TARGETS = {"load_s": 5.0, "peak_rss_mib": 1536.0}

LOAD = """
import json, resource, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0, c0 = time.perf_counter(), cpu()
from asyncinfer import AsyncEngine
t1, c1 = time.perf_counter(), cpu()
engine = AsyncEngine.from_pretrained()
t2, c2 = time.perf_counter(), cpu()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "load_cpu_s": c2 - c1,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "kv": engine.memory_plan.describe()}))
"""

BREAKDOWN = """
import json, resource, time
from pathlib import Path
marks = {}
t = time.perf_counter()
def mark(name):
    global t
    now = time.perf_counter()
    marks[name] = now - t
    t = now
import torch; mark("import torch")
import asyncinfer; mark("import asyncinfer (rest)")
from asyncinfer.config import EngineConfig
from asyncinfer.loading import build_core, warm_up
from asyncinfer.memory import plan_memory
from asyncinfer.model_source import resolve_model
from asyncinfer.models.loader import LoadedModel, _iter_gguf, _materialise, gguf_tokenizer, open_checkpoint
config = EngineConfig()
path = resolve_model(None); mark("resolve the cached model")
checkpoint = open_checkpoint(path); mark("parse the GGUF header")
plan_memory(checkpoint.config); mark("plan memory from the config")
tokenizer = gguf_tokenizer(path); mark("load the cached tokenizer (transformers import included)")
model = _materialise(checkpoint.config, _iter_gguf(checkpoint.gguf, checkpoint.config), "gguf", config.dtype,
                     config.device, adopt=True); mark("dequantise and place the weights")
plan, core = build_core(LoadedModel(model, checkpoint.config, tokenizer, "gguf"), config)
mark("build the core (KV tensors)")
warm_up(core); mark("warm-up step")
print(json.dumps({"phases": marks, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
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


def run_load(tree: Path) -> dict[str, Any]:
    wall, rss, out = spawn([sys.executable, "-c", LOAD], env_for(tree))
    record = json.loads(out.strip().splitlines()[-1])
    return {**record, "process_s": wall, "peak_rss_mib": max(rss, record["peak_rss_mib"])}


def run_chat(tree: Path) -> dict[str, Any]:
    wall, rss, out = spawn([sys.executable, "-m", "asyncinfer.cli", "chat", PROMPT], env_for(tree))
    return {"process_s": wall, "peak_rss_mib": rss, "answer": out.strip()}


def run_breakdown(tree: Path) -> dict[str, Any]:
    _, _, out = spawn([sys.executable, "-c", BREAKDOWN], env_for(tree))
    return json.loads(out.strip().splitlines()[-1])


def run_cold(tree: Path) -> dict[str, Any]:
    """A load with an empty tokenizer cache: the model file linked into a fresh cache directory."""
    sys.path.insert(0, str(tree / "src"))
    from asyncinfer.model_source import default_model_path

    model = default_model_path()
    with tempfile.TemporaryDirectory() as cache:
        target = Path(cache) / model.parent.name / model.name
        target.parent.mkdir()
        target.symlink_to(model)
        wall, rss, out = spawn([sys.executable, "-c", LOAD], env_for(tree, ASYNCINFER_CACHE_DIR=cache))
    record = json.loads(out.strip().splitlines()[-1])
    return {**record, "process_s": wall, "peak_rss_mib": max(rss, record["peak_rss_mib"])}


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
    args = p.parse_args()
    head = HERE
    runs: dict[str, list[dict[str, Any]]] = {"load": [], "chat": [], "base load": [], "base chat": []}
    started = loadavg()
    base_rounds = args.rounds if args.base_rounds is None else args.base_rounds
    for i in range(args.rounds):
        order = [("load", run_load, head), ("chat", run_chat, head)]
        if args.base is not None and i < base_rounds:
            order += [("base load", run_load, args.base), ("base chat", run_chat, args.base)]
        for name, fn, tree in (order if i % 2 == 0 else order[::-1]):
            result = fn(tree)
            runs[name].append(result)
            shown = f"load {result['load_s']:.2f} s, " if "load_s" in result else ""
            print(f"round {i + 1} {name}: {shown}process {result['process_s']:.2f} s, "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
    breakdown = run_breakdown(head)
    cold = run_cold(head)
    summary = {name: medians(r) for name, r in runs.items() if r}
    met = {k: summary["load"][k] <= limit for k, limit in TARGETS.items()}
    print("\nmedians:")
    for name, values in summary.items():
        print(f"  {name:<10} " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    print("\nbreakdown of one load, phase by phase (s):")
    for phase, seconds in breakdown["phases"].items():
        print(f"  {seconds:6.2f}  {phase}")
    print(f"\nfirst load with an empty tokenizer cache: load {cold['load_s']:.2f} s, "
          f"peak RSS {cold['peak_rss_mib']:.0f} MiB")
    print(f"targets (load <= {TARGETS['load_s']} s, peak RSS <= {TARGETS['peak_rss_mib']:.0f} MiB): "
          f"{'met' if all(met.values()) else 'NOT met'} {met}")
    print(f"load average: {started} at the start, {loadavg()} at the end (2 cores: above 2 means contention)")
    if args.json:
        record = {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                        "loadavg_start": started, "loadavg_end": loadavg()},
            "base": args.base_label or (str(args.base) if args.base else None),
            "targets": TARGETS, "targets_met": met,
            "medians": summary, "runs": runs, "breakdown": breakdown, "cold_tokenizer_cache": cold,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
