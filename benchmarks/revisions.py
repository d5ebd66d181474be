"""asyncinfer at two git revisions, on the same model, workload and driver, in one run.

The base revision's ``src`` is extracted from git (``git archive``) into a temporary
directory; the head is the current checkout's ``src`` (its working tree, uncommitted changes
included) unless ``--head REV`` names a revision, which is extracted the same way. Every
measurement runs in a fresh process whose ``PYTHONPATH`` is that revision's ``src`` alone,
executing this file (the current checkout's driver) through the public API only:
``AsyncEngine.from_pretrained(model, ...)``, ``async with engine``, ``engine.generate``.
Each process measures, in one engine session:

- the batched throughput of the workload (``common.build_workload``, every request at t=0,
  greedy, EOS ignored), tok/s of useful output tokens;
- the single-request decode rate (``common.engine_decode_rate``: ``(n-1)/(T(n)-T(1))``);
- the greedy token ids of every request.

Each process runs the batched workload ``--batched-repeats`` times and keeps the fastest (the later repeats find
the prompts in the prefix cache; a request whose greedy tokens then take the other of two near-equal candidates is
counted in ``repeat_flipped_requests``, a mean common prefix under ``REPEAT_MIN_PREFIX`` fails the run), with
the process CPU time it took (``time.process_time``: a second view, less sensitive to other
load on the machine than wall time). A round (``--design abba``, the default) runs base,
head, head, base (the next round head, base, base, head): each revision is measured first,
second, third and fourth equally often, so a steady drift of the machine and an effect of a
run's position cancel in the round's ratio (geometric means of each revision's runs). Each
round gives a head/base ratio for both rates and for CPU time a token, and the report gives
their medians and spread, and how many requests' tokens are identical. ``--design ab`` is
the older one run of each per round, the order alternating between rounds.

    python benchmarks/revisions.py --json benchmarks/results/revisions.json      # edacc11 vs the checkout
    python benchmarks/revisions.py --num-requests 2 --min-new-tokens 4 --max-new-tokens 8 \\
        --decode-tokens 8 --repeats 1 --rounds 1 --batched-repeats 1              # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

from common import build_workload, engine_decode_rate, hf_load_args, machine_info, resolve_model_path

BENCH_DIR = Path(__file__).resolve().parent

KV_DTYPE_BYTES = 4  # float32 activations, so a float32 KV cache
BLOCK_SIZE = 16


def say(message: str) -> None:
    """Progress line on stderr (the report goes to stdout)."""
    print(f"[revisions] {message}", file=sys.stderr, flush=True)


# =========================================================================== one measurement (child process)

def kernel_libraries() -> list[str]:
    """The compiled kernel libraries mapped into this process (which build of the kernels ran)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if "gguf_gemm" in line or "_kernels_" in line
                   or "/kernels-" in line})


#: The least mean common prefix (a fraction of each request's tokens) a later repeat of the batched workload may share
#: with the first: near-tie flips from the block kernels' batch-size-dependent rounding are tolerated, not a broken engine.
REPEAT_MIN_PREFIX = 0.9


def repeat_prefix(a: list[int], b: list[int]) -> float:
    """The fraction of the longer of ``a`` and ``b`` that they share from the start (the child's own: the measured
    revision's asyncinfer may predate ``asyncinfer.models.quality.common_prefix``, which the parent uses)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


async def _session(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from asyncinfer import SamplingParams

    prompts, lengths = spec["prompt_ids"], spec["max_new_tokens"]

    def submit_all(ps: list[list[int]], ns: list[int]) -> Any:
        return asyncio.gather(*(engine.generate(list(p), SamplingParams(max_tokens=n, ignore_eos=True))
                                for p, n in zip(ps, ns)))

    async with engine:
        await submit_all(prompts[:2], [4] * len(prompts[:2]))  # warm-up
        walls, cpus, tokens = [], [], None
        flipped: list[int] = []  # per later repeat: requests whose greedy tokens differ from the first repeat's
        for _ in range(spec["batched_repeats"]):
            start, cpu = time.perf_counter(), time.process_time()
            outs = await submit_all(prompts, lengths)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
            ids = [list(o.token_ids) for o in outs]
            if tokens is None:
                tokens = ids
            else:
                # A later repeat finds the prompts in the prefix cache, so its steps hold other numbers of rows, and
                # the block kernels' logits move in their last digits with that (docs/reliability.md, "Seeded
                # sampling"): a greedy token may take the other of two near-equal candidates. Anything more is a bug.
                same = [a == b for a, b in zip(ids, tokens)]
                flipped.append(len(same) - sum(same))
                shared = statistics.fmean(repeat_prefix(a, b) for a, b in zip(ids, tokens))
                if shared < REPEAT_MIN_PREFIX:
                    raise RuntimeError(f"the batched workload's greedy tokens changed between repeats in one process "
                                       f"(mean common prefix {shared:.3f})")
        decode = await engine_decode_rate(engine, list(prompts[0]), spec["decode_tokens"], spec["repeats"])
    assert tokens is not None
    wrong = [i for i, (t, n) in enumerate(zip(tokens, lengths)) if len(t) != n]
    if wrong:
        raise RuntimeError(f"wrong number of tokens for requests {wrong[:8]}")
    best = min(range(len(walls)), key=walls.__getitem__)
    return {"wall_s": walls[best], "walls_s": walls, "cpu_s": cpus[best], "cpus_s": cpus,
            "output_tokens": sum(lengths), "tokens_per_s": sum(lengths) / walls[best],
            "cpu_ms_per_token": 1000 * cpus[best] / sum(lengths),
            "single_decode": decode, "token_ids": tokens, "repeat_flipped_requests": flipped}


def child(spec_path: Path, out_path: Path) -> int:
    """One measurement with whichever asyncinfer is first on the path (checked against the spec)."""
    spec = json.loads(spec_path.read_text())
    import torch

    import asyncinfer
    from asyncinfer import AsyncEngine

    where = Path(asyncinfer.__file__).resolve()
    expected = Path(spec["src"]).resolve()
    if expected not in where.parents:
        raise SystemExit(f"asyncinfer came from {where}, not from {expected}")
    say(f"{spec['label']}: asyncinfer from {where}")
    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    engine = AsyncEngine.from_pretrained(spec["model"], **spec["engine_options"])
    load_s = time.perf_counter() - start
    result = asyncio.run(_session(engine, spec))
    result.update({
        "asyncinfer_file": str(where),
        "kernel_libraries": kernel_libraries(),
        "weight_format": engine.config.quantization or str(engine.config.dtype),
        "load_s": load_s,
        "pid": os.getpid(),
    })
    out_path.write_text(json.dumps(result))
    return 0


# =========================================================================== the comparison (parent process)

def _interrupted(signum: int, frame: Any) -> None:
    """SIGTERM takes Ctrl-C's way out, so the extracted sources are removed either way."""
    raise KeyboardInterrupt


def git(*args: str, cwd: Path) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def extract_src(repo: Path, commit: str, into: Path) -> Path:
    """``src`` of ``commit`` written under ``into`` (``git archive``: no worktree, nothing left in git)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "src"], cwd=repo, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def run_one(label: str, src: Path, spec: dict[str, Any], tmp: Path, index: int,
            extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """One fresh process measuring ``src``'s asyncinfer with this file's driver (``extra_env`` added to its
    environment: ``--base-env`` / ``--head-env``)."""
    spec_path, out_path = tmp / f"spec-{index}.json", tmp / f"result-{index}.json"
    spec_path.write_text(json.dumps({**spec, "label": label, "src": str(src)}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"PYTHONPATH": str(src), "TQDM_DISABLE": "1", **(extra_env or {})})
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path), str(out_path)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {label} measurement failed (exit {proc.returncode})")
    return json.loads(out_path.read_text())


def token_identity(base: list[list[int]], head: list[list[int]]) -> dict[str, Any]:
    identical = sum(a == b for a, b in zip(base, head))
    from asyncinfer.models.quality import common_prefix  # the parent's own checkout (children never call this)

    prefix = [common_prefix(a, b) / max(len(a), len(b), 1) for a, b in zip(base, head)]
    return {"identical": identical, "compared": len(base), "mean_common_prefix": statistics.fmean(prefix),
            "differing_requests": [i for i, (a, b) in enumerate(zip(base, head)) if a != b]}


def round_order(r: int, design: str) -> tuple[str, ...]:
    """The runs of round ``r`` (0-based). ``abba``: base, head, head, base, then head, base, base, head: each
    revision takes every position of a round equally often, so a linear drift and an effect of running
    first or second cancel in each round's ratio. ``ab``: one run of each, the order alternating."""
    if design == "ab":
        return ("base", "head") if r % 2 == 0 else ("head", "base")
    return ("base", "head", "head", "base") if r % 2 == 0 else ("head", "base", "base", "head")


#: The figures a round compares, each read from one run's result.
FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "batched": lambda run: run["tokens_per_s"],
    "single": lambda run: run["single_decode"]["decode_tokens_per_s"],
    "cpu": lambda run: run["cpu_ms_per_token"],
}


def round_mean(runs: list[dict[str, Any]], figure: Callable[[dict[str, Any]], float]) -> float:
    """The geometric mean of ``figure`` over one revision's runs in a round (the plain mean where a tiny smoke
    run timed a non-positive rate)."""
    values = [figure(run) for run in runs]
    return statistics.geometric_mean(values) if min(values) > 0 else statistics.fmean(values)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def engine_options(workload: Any, config: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The same options for both revisions: the engine's default format for the model (``dtype="auto"``:
    float32 activations), a KV cache for ``max_num_seqs`` requests of the longest length (no preemption);
    ``--activation-dtype``, when given, for both."""
    longest = max(workload.max_seq_len, len(workload.prompt_ids[0]) + args.decode_tokens)
    max_model_len = math.ceil((longest + 1) / BLOCK_SIZE) * BLOCK_SIZE
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * KV_DTYPE_BYTES
    return {
        "dtype": "auto",
        "device": "cpu",
        "block_size": BLOCK_SIZE,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": max_model_len,
        "kv_cache_memory": int(args.max_num_seqs * max_model_len * kv_bytes_per_token * 1.1) + 16 * 2**20,
        "num_threads": args.threads,
        "seed": args.seed,
    } | ({"activation_dtype": args.activation_dtype} if args.activation_dtype else {})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="edacc11",
                   help="the older git revision (default: edacc11); '.' for the current checkout's working tree")
    p.add_argument("--head", default=None,
                   help="the newer git revision (default: the current checkout's working tree)")
    p.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the base's processes (repeatable), e.g. "
                        "ASYNCINFER_KERNEL_ISA=avx2 with --base . to compare kernel variants of one checkout")
    p.add_argument("--head-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the head's processes (repeatable)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds, each two runs of each revision (--design abba) or one of each (ab)")
    p.add_argument("--design", choices=("abba", "ab"), default="abba",
                   help="abba (default): each round runs base, head, head, base (then head, base, base, head) "
                        "and compares geometric means, cancelling drift and position; ab: one run of each, "
                        "the order alternating between rounds")
    p.add_argument("--batched-repeats", type=int, default=2,
                   help="times the batched workload runs in each process (the fastest is kept)")
    p.add_argument("--model", help="a .gguf file or HF model directory (default: asyncinfer's default model)")
    p.add_argument("--threads", type=int, default=2, help="the engine's num_threads")
    p.add_argument("--activation-dtype", choices=("int16", "int8"), default=None,
                   help="the engines' activation_dtype, both revisions (default: the engine's own)")
    p.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-new-tokens", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=128, help="new tokens in the single-request decode test")
    p.add_argument("--repeats", type=int, default=3, help="repeats (median) of the single-request timings")
    p.add_argument("--json", type=Path, help="write the record here")
    p.add_argument("--child", nargs=2, type=Path, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.batched_repeats < 1:
        p.error("--batched-repeats must be at least 1")
    for option in ("base_env", "head_env"):
        pairs = {}
        for item in getattr(args, option):
            name, sep, value = item.partition("=")
            if not sep or not name:
                p.error(f"--{option.replace('_', '-')} takes NAME=VALUE, got {item!r}")
            pairs[name] = value
        setattr(args, option, pairs)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(*args.child)

    repo = Path(git("rev-parse", "--show-toplevel", cwd=BENCH_DIR))
    base_tree = args.base == "."
    base_commit = git("rev-parse", "--verify", f"{'HEAD' if base_tree else args.base}^{{commit}}", cwd=repo)
    if args.head is None:
        head_commit = git("rev-parse", "HEAD", cwd=repo)
        head_dirty = bool(git("status", "--porcelain", "--", "src", cwd=repo))
        head_name = f"working tree (HEAD {head_commit[:12]}{', src modified' if head_dirty else ''})"
    else:
        head_commit = git("rev-parse", "--verify", f"{args.head}^{{commit}}", cwd=repo)
        head_dirty = False
        head_name = f"{args.head} ({head_commit[:12]})"
    base_name = f"working tree (HEAD {base_commit[:12]})" if base_tree else f"{args.base} ({base_commit[:12]})"
    if args.base_env:
        base_name += " with " + " ".join(f"{k}={v}" for k, v in args.base_env.items())
    if args.head_env:
        head_name += " with " + " ".join(f"{k}={v}" for k, v in args.head_env.items())

    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)  # recorded by machine_info; this process runs no torch work
    model_path = resolve_model_path(args.model)
    directory, hf_kwargs = hf_load_args(model_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, **hf_kwargs)
    config = AutoConfig.from_pretrained(directory, **hf_kwargs)
    workload = build_workload(tokenizer, args.num_requests, args.seed, args.min_new_tokens, args.max_new_tokens)
    spec = {
        "model": str(model_path),
        "threads": args.threads,
        "engine_options": engine_options(workload, config, args),
        "prompt_ids": [list(p) for p in workload.prompt_ids],
        "max_new_tokens": list(workload.max_new_tokens),
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "batched_repeats": args.batched_repeats,
    }
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/revisions.py", *sys.argv[1:]])
    say(f"base {base_name}, head {head_name}; {workload.num_requests} requests, "
        f"{workload.total_output_tokens} output tokens, {args.rounds} rounds")

    signal.signal(signal.SIGTERM, _interrupted)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="asyncinfer-revisions-") as tmp_name:
        tmp = Path(tmp_name)
        srcs = {"base": repo / "src" if base_tree else extract_src(repo, base_commit, tmp / "base"),
                "head": repo / "src" if args.head is None else extract_src(repo, head_commit, tmp / "head")}
        index = 0
        for r in range(args.rounds):
            for label in round_order(r, args.design):
                result = run_one(label, srcs[label], spec, tmp, index,
                                 args.base_env if label == "base" else args.head_env)
                index += 1
                result["round"] = r + 1
                result["order"] = index
                runs[label].append(result)
                say(f"round {r + 1} {label}: {result['tokens_per_s']:.1f} tok/s batched "
                    f"({result['cpu_ms_per_token']:.2f} CPU ms/token), "
                    f"{result['single_decode']['decode_tokens_per_s']:.1f} tok/s one request "
                    f"({result['weight_format']}; asyncinfer {result['asyncinfer_file']})")
        for label in ("base", "head"):  # where the code ran from: not a path that outlives the run
            for result in runs[label]:
                result["asyncinfer_file"] = result["asyncinfer_file"].replace(tmp_name, "<extracted>")
                result["kernel_libraries"] = [k.replace(tmp_name, "<extracted>") for k in result["kernel_libraries"]]

    rounds = []
    per_round = len(round_order(0, args.design)) // 2
    for r in range(args.rounds):
        b_runs = runs["base"][r * per_round:(r + 1) * per_round]
        h_runs = runs["head"][r * per_round:(r + 1) * per_round]
        base = {name: round_mean(b_runs, figure) for name, figure in FIGURES.items()}
        head = {name: round_mean(h_runs, figure) for name, figure in FIGURES.items()}
        rounds.append({
            "round": r + 1,
            "order": ", ".join(round_order(r, args.design)),
            "base_tokens_per_s": base["batched"],
            "head_tokens_per_s": head["batched"],
            "throughput_ratio": head["batched"] / base["batched"],
            "base_cpu_ms_per_token": base["cpu"],
            "head_cpu_ms_per_token": head["cpu"],
            # base CPU time over head CPU time: above 1 when the head spends less CPU a token
            "cpu_ratio": base["cpu"] / head["cpu"],
            "base_single_decode_tokens_per_s": base["single"],
            "head_single_decode_tokens_per_s": head["single"],
            "single_decode_ratio": head["single"] / base["single"],
            "tokens": token_identity(b_runs[0]["token_ids"], h_runs[0]["token_ids"]),
        })
    identical = [x["tokens"]["identical"] for x in rounds]
    stable = {label: all(run["token_ids"] == runs[label][0]["token_ids"] for run in runs[label])
              for label in ("base", "head")}
    summary = {
        "throughput_ratio": spread([x["throughput_ratio"] for x in rounds]),
        "cpu_ratio": spread([x["cpu_ratio"] for x in rounds]),
        "single_decode_ratio": spread([x["single_decode_ratio"] for x in rounds]),
        "base_tokens_per_s": spread([x["base_tokens_per_s"] for x in rounds]),
        "head_tokens_per_s": spread([x["head_tokens_per_s"] for x in rounds]),
        "base_single_decode_tokens_per_s": spread([x["base_single_decode_tokens_per_s"] for x in rounds]),
        "head_single_decode_tokens_per_s": spread([x["head_single_decode_tokens_per_s"] for x in rounds]),
        "tokens_identical_min": min(identical),
        "tokens_compared": workload.num_requests,
        "tokens_same_every_round": stable,
    }

    # ------------------------------------------------------------------ report
    print(f"asyncinfer head {head_name} vs base {base_name}")
    print(f"model {model_path}, {args.threads} threads, {workload.num_requests} requests "
          f"({workload.total_output_tokens} output tokens), single-request decode {args.decode_tokens} tokens, "
          f"median of {args.repeats}")
    print(f"{'round':<7}{'order':<26}{'base tok/s':>11}{'head tok/s':>11}{'ratio':>8}{'CPU ratio':>10}"
          f"{'base 1-req':>12}{'head 1-req':>12}{'ratio':>8}{'tokens':>9}")
    for x in rounds:
        t = x["tokens"]
        print(f"{x['round']:<7}{x['order']:<26}{x['base_tokens_per_s']:>11.1f}{x['head_tokens_per_s']:>11.1f}"
              f"{x['throughput_ratio']:>7.3f}x{x['cpu_ratio']:>9.3f}x{x['base_single_decode_tokens_per_s']:>12.1f}"
              f"{x['head_single_decode_tokens_per_s']:>12.1f}{x['single_decode_ratio']:>7.3f}x"
              f"{t['identical']:>5}/{t['compared']}")
    th, sd, cp = summary["throughput_ratio"], summary["single_decode_ratio"], summary["cpu_ratio"]
    print(f"head / base, median of {len(rounds)} (min-max): throughput {th['median']:.3f}x "
          f"({th['min']:.3f}-{th['max']:.3f}), CPU time a token (base/head) {cp['median']:.3f}x "
          f"({cp['min']:.3f}-{cp['max']:.3f}), one request {sd['median']:.3f}x ({sd['min']:.3f}-{sd['max']:.3f})")
    print(f"greedy tokens: {summary['tokens_identical_min']}/{workload.num_requests} requests identical "
          f"(fewest in a round); each revision the same in every round: base {stable['base']}, head {stable['head']}")

    if args.json:
        record = {
            "command": command,
            "machine": machine_info(),
            "model": str(model_path),
            "revisions": {
                "base": {"rev": args.base, "commit": base_commit,
                         "source": "the checkout" if base_tree else "git archive", "env": args.base_env},
                "head": {"rev": args.head or "working tree", "commit": head_commit, "src_modified": head_dirty,
                         "source": "the checkout" if args.head is None else "git archive", "env": args.head_env},
            },
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
            "workload": workload.summary(),
            "engine_options": spec["engine_options"],
            "rounds": rounds,
            "summary": summary,
            # each run's figures; the token ids once per revision (its first run), one string a request
            "runs": {label: [{k: v for k, v in run.items() if k != "token_ids"} for run in runs[label]]
                     for label in runs},
            "token_ids": {label: [" ".join(map(str, t)) for t in runs[label][0]["token_ids"]] for label in runs},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
