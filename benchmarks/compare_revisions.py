"""Throughput of two source trees of asyncinfer, side by side: did a change regress speed?

Runs each tree's own ``benchmarks/throughput.py`` (asyncinfer only, the same workload
and options) in a fresh process with that tree's ``src`` first on the path, alternating
base and head for ``--rounds`` rounds so that machine noise hits both alike, and reports
the median batch throughput and single-request decode rate of each and their ratio.

    git worktree add /tmp/base <old-commit>
    python benchmarks/compare_revisions.py --base /tmp/base --head . --rounds 3 \\
        --json benchmarks/results/regression.json -- --num-requests 32 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SKIP = ["--skip-hf-single", "--skip-hf-static", "--skip-hf-cb", "--skip-roofline"]


def run_tree(tree: Path, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        cmd = [sys.executable, str(tree / "benchmarks" / "throughput.py"), *SKIP, *extra, "--json", str(out)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        record = json.loads(out.read_text())
    ours = record["results"]["asyncinfer"]
    single = record["single_request_decode"].get("asyncinfer", {})
    return {"tokens_per_s": ours["tokens_per_s"], "single_decode_tokens_per_s": single.get("decode_tokens_per_s")}


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the older source tree (a git worktree)")
    p.add_argument("--head", type=Path, default=Path("."), help="the newer source tree")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the runs and medians here")
    p.add_argument("extra", nargs="*", help="options for throughput.py (after --)")
    args = p.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
    for i in range(args.rounds):
        for name in (("base", "head") if i % 2 == 0 else ("head", "base")):
            tree = args.base if name == "base" else args.head
            result = run_tree(tree.resolve(), args.extra)
            runs[name].append(result)
            print(f"round {i + 1} {name}: {result['tokens_per_s']:.1f} tok/s batched, "
                  f"{result['single_decode_tokens_per_s'] or float('nan'):.1f} tok/s single-request decode", flush=True)
    summary: dict[str, Any] = {}
    for key in ("tokens_per_s", "single_decode_tokens_per_s"):
        base, head = median_of(runs["base"], key), median_of(runs["head"], key)
        summary[key] = {"base": base, "head": head, "head_over_base": (head / base) if base and head else None}
        if base and head:
            print(f"{key}: base {base:.1f}, head {head:.1f}, head/base {head / base:.3f} (medians of {args.rounds})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"base": str(args.base), "head": str(args.head), "extra": args.extra,
                                         "runs": runs, "medians": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
