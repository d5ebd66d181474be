"""``asyncinfer plan``'s total against the peak memory of what it plans for, measured.

For each of ``--settings`` (BATCHxSEQ_LEN) the plan is made for BATCH requests of SEQ_LEN tokens; then the engine
is started with the options the plan prints, twice, each in a process of its own: in-process
(``AsyncEngine.load``, what an application that embeds it holds) and behind ``asyncinfer serve`` (the HTTP
server's imports and connections besides). Each runs BATCH requests at once whose prompts (token ids, so their
length is exact) and outputs fill SEQ_LEN tokens, and its peak resident memory (``VmHWM``) is read when they are
done::

    python benchmarks/plan_check.py --json benchmarks/results/plan_check.json

The plan's activations and framework overhead are estimates; this is the check of them.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, git_commit, write_record

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def plan(model: str | None, batch: int, seq_len: int) -> tuple[int, dict[str, Any], str, str]:
    """The plan's total bytes, its engine options, its flags and its output, from the command."""
    cmd = [sys.executable, "-m", "asyncinfer", "plan", "--batch", str(batch), "--seq-len", str(seq_len),
           "--device-memory", "1TiB"] + ([model] if model else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    total = re.search(r"^\s+total\s+([\d.]+) (\w+)", out, re.MULTILINE)
    options = re.search(r"^engine options that load this plan \(with device\): (.*)$", out, re.MULTILINE)
    flags = re.search(r"^the same as flags: (.*)$", out, re.MULTILINE)
    if total is None or options is None or flags is None:
        raise SystemExit(f"cannot read the plan's total and options from:\n{out}")
    values = dict(item.split("=", 1) for item in options.group(1).split())
    return (int(float(total.group(1)) * UNITS[total.group(2)]), {k: ast.literal_eval(v) for k, v in values.items()},
            flags.group(1), out)


def prompts(batch: int, seq_len: int, max_tokens: int) -> list[list[int]]:
    """``batch`` distinct prompts of token ids (no prefix shared: the cache would hold less) that leave
    ``max_tokens`` of room in ``seq_len``."""
    length = seq_len - max_tokens - 1
    return [[100 + (i * 7919 + j * 31) % 20_000 for j in range(length)] for i in range(batch)]


ENGINE_CHILD = """
import asyncio, json, sys
from asyncinfer import AsyncEngine, SamplingParams
model, options, prompts, max_tokens, threads = json.loads(sys.argv[1])
async def main():
    engine = await AsyncEngine.load(model, device="cpu", num_threads=threads, **options)
    async with engine:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    print(open("/proc/self/status").read())
asyncio.run(main())
"""


def peak_of(status: str) -> int:
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    if found is None:
        raise SystemExit("no VmHWM in /proc/PID/status (Linux only)")
    return int(found.group(1)) * 1024


def engine_peak(model: str | None, options: dict[str, Any], batch: list[list[int]], max_tokens: int,
                threads: int) -> int:
    out = subprocess.run([sys.executable, "-c", ENGINE_CHILD, json.dumps([model, options, batch, max_tokens, threads])],
                         capture_output=True, text=True, check=True).stdout
    return peak_of(out)


def serve_peak(model: str | None, flags: str, batch: list[list[int]], max_tokens: int, threads: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ([sys.executable, "-m", "asyncinfer", "serve"] + ([model] if model else [])
           + ["--port", str(port), "--threads", str(threads)] + flags.split())
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start: {' '.join(cmd)}") from None
                time.sleep(0.5)

        def complete(prompt: list[int]) -> None:
            body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as answer:
                answer.read()

        with ThreadPoolExecutor(len(batch)) as pool:
            list(pool.map(complete, batch))
        return peak_of(Path(f"/proc/{server.pid}/status").read_text())
    finally:
        server.terminate()
        server.wait(60)


def setting(text: str) -> tuple[int, int]:
    batch, _, seq_len = text.partition("x")
    if not batch.isdigit() or not seq_len.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is no BATCHxSEQ_LEN (e.g. 4x1024)")
    return int(batch), int(seq_len)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the model (default: the default model)")
    p.add_argument("--settings", type=setting, nargs="+", default=[(1, 1024), (4, 1024), (16, 512), (1, 4096),
                                                                   (4, 4096)],
                   help="BATCHxSEQ_LEN each: requests at once, of tokens a request, prompt + output "
                        "(default: 1x1024 4x1024 16x512 1x4096 4x4096)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens a request (default: 128)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--json", type=Path, default=None, help="write the record here")
    args = p.parse_args()
    mib, runs = 2**20, []
    for batch_size, seq_len in args.settings:
        total, options, flags, _ = plan(args.model, batch_size, seq_len)
        batch = prompts(batch_size, seq_len, args.max_tokens)
        peaks = {"engine": engine_peak(args.model, options, batch, args.max_tokens, args.threads),
                 "serve": serve_peak(args.model, flags, batch, args.max_tokens, args.threads)}
        print(f"{batch_size} x {seq_len} tokens: plan total {total / mib:.1f} MiB; "
              + "; ".join(f"{name} peak {peak / mib:.1f} MiB ({peak / total:.0%})" for name, peak in peaks.items()),
              flush=True)
        runs.append({"batch": batch_size, "seq_len": seq_len, "flags": flags, "plan_total_mib": round(total / mib, 1),
                     **{f"{name}_peak_mib": round(peak / mib, 1) for name, peak in peaks.items()},
                     **{f"{name}_of_plan": round(peak / total, 3) for name, peak in peaks.items()}})
    if args.json:
        write_record(args.json, {"commit": git_commit(), "cpu": cpu_model(), "threads": args.threads,
                                 "model": args.model or "default", "max_tokens": args.max_tokens, "runs": runs})


if __name__ == "__main__":
    main()
