"""The token embedding in its file's blocks against a float32 table: a decode step's CPU time and the memory.

Since the embedding stays in its GGUF file's blocks (``models.quant.BlockEmbedding``), the one-call decode step
(``kernels.DecodeStack``) dequantizes the step's rows itself, straight into the residual stream. This script
runs that step on one loaded model (the default model unless ``--model``), alternating in one process, the same
token ids, positions and caches for each:

- ``float32``: the float32 table [vocab, hidden] that main held (the same values: ``kernels.embed_rows`` of
  every id), its rows copied by the call;
- ``blocks``: the embedding's blocks (``KernelDecode.embed``), its rows dequantized by the call;
- ``torch_rows``: the blocks' rows gathered and dequantized with torch before the call
  (``BlockTable.rows``, then the float32 step), what the step did before the C path, emulated.

The figure is CPU time per step (``time.process_time``, one thread): on a shared machine it is less disturbed
than the wall clock, but still rough; compare the modes of one run, round by round, not across runs. Beside it,
each mode's rows alone (``kernels.embed_rows`` of the table or the blocks, ``BlockTable.rows``), CPU time per
call, the Python checks of ``embed_rows`` included (the stack makes them once per table, not per step): an
upper bound of what the C rows add to a step, and close to what the torch rows did. With
``--memory`` it also loads the model in two child processes, the embedding in its blocks and as a float32 table
(``quantization_skip=("embed_tokens",)``), and reports the planner's weight bytes and each child's RSS after load.

    python benchmarks/embedding_step.py --json benchmarks/results/embedding_step.json --memory
    python benchmarks/embedding_step.py --batch 1 --steps 4 --rounds 2      # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info, resolve_model_path, write_record

MODES = ("float32", "blocks", "torch_rows")
MiB = 2**20


def rss_now_mib() -> float:
    """This process's resident set now (VmRSS)."""
    with open("/proc/self/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child_memory(model: Path, table: str) -> dict[str, float]:
    """Load the engine (the default options) with the embedding as ``table`` says; RSS before and after."""
    import torch  # noqa: F401  (imported before the first figure: the load is what is measured)

    from asyncinfer import AsyncEngine

    before = rss_now_mib()
    skip = ("embed_tokens",) if table == "float32" else ()
    engine = AsyncEngine.from_pretrained(model, max_model_len=256, kv_cache_memory=16 * MiB, quantization_skip=skip)
    after = rss_now_mib()
    held = type(engine.core.runner.model.embed_tokens).__name__
    return {"rss_after_imports_mib": before, "rss_after_load_mib": after, "load_mib": after - before,
            "embedding": held}


def memory(model: Path) -> dict[str, Any]:
    """The planner's weight bytes and each child's RSS after load, the embedding in blocks and as a table."""
    from asyncinfer.models.loader import open_checkpoint
    from asyncinfer.models.quant import embedding_formats, weight_bytes

    config = open_checkpoint(model).config
    method = "native"  # what "auto" takes on a file in block formats (the default model's)
    out: dict[str, Any] = {
        "embedding_format": embedding_formats(config, method)["embed_tokens"],
        "planner_weight_bytes": {"blocks": weight_bytes(config, 4, method),
                                 "float32": weight_bytes(config, 4, method, ("embed_tokens",))},
        "rss": {},
    }
    for table in ("blocks", "float32"):
        done = subprocess.run([sys.executable, __file__, "--model", str(model), "--child-memory", table],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"the {table} child failed:\n{done.stderr[-3000:]}")
        out["rss"][table] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def step_times(model: Path, batches: list[int], steps: int, rounds: int, context: int, seed: int) -> dict[str, Any]:
    """Per-step CPU seconds of each mode, round by round, for each batch size."""
    import torch

    from asyncinfer import AsyncEngine, kernels
    from asyncinfer.models.decode_backends import KernelDecode

    torch.set_num_threads(1)
    engine = AsyncEngine.from_pretrained(model, max_model_len=max(256, context + 1),
                                         kv_cache_memory=(max(batches) * (context + 32) * 2**14) + 16 * MiB)
    runner = engine.core.runner
    decode = runner.decode
    if not isinstance(decode, KernelDecode) or not isinstance(decode.embed, kernels.BlockTable):
        raise SystemExit(f"{model}: no one-call step from an embedding in blocks here ({type(decode).__name__}, "
                         f"{type(decode.model.embed_tokens).__name__}); nothing to compare")
    blocks = decode.embed
    vocab = blocks.shape[0]
    table = kernels.embed_rows(blocks, torch.arange(vocab))  # main's float32 table: the same values
    stack, rotary, caches = decode.stack, decode.model.rotary, runner.kv_caches
    block_size = caches[0][0].shape[1]
    per_seq = -(-context // block_size)
    if max(batches) * per_seq > caches[0][0].shape[0]:
        raise SystemExit("the KV cache is too small for --batch x --context")
    rng = random.Random(seed)
    ids_by_step = [[rng.randrange(vocab) for _ in range(max(batches))] for _ in range(steps)]

    def packed_step(ids: list[int]) -> list[int]:
        n = len(ids)  # sequence i: blocks i * per_seq ..., a context of `context` tokens, its last one new
        tables = [i * per_seq + j for i in range(n) for j in range(per_seq)]
        slots = [(i * per_seq) * block_size + context - 1 for i in range(n)]
        return ids + [context - 1] * n + slots + [context] * n + tables

    def run(mode: str, batch: int) -> float:
        steps_in = [packed_step(ids[:batch]) for ids in ids_by_step]
        start = time.process_time()
        for ids, packed in zip(ids_by_step, steps_in):
            if mode == "blocks":
                stack.decode_packed(packed, batch, per_seq, blocks, rotary.cos_cache, rotary.sin_cache, caches)
            elif mode == "float32":
                stack.decode_packed(packed, batch, per_seq, table, rotary.cos_cache, rotary.sin_cache, caches)
            else:  # the rows in torch first (as before the C path), then a step that reads them
                blocks.rows(torch.tensor(ids[:batch]))
                stack.decode_packed(packed, batch, per_seq, table, rotary.cos_cache, rotary.sin_cache, caches)
        return (time.process_time() - start) / steps

    def rows_alone(mode: str, batch: int, calls: int) -> float:
        """CPU seconds per call of the embedding's rows alone: what each mode adds to a step."""
        ids = [torch.tensor(i[:batch]) for i in ids_by_step]
        start = time.process_time()
        for k in range(calls):
            step_ids = ids[k % len(ids)]
            if mode == "blocks":
                kernels.embed_rows(blocks, step_ids)
            elif mode == "float32":
                kernels.embed_rows(table, step_ids)
            else:
                blocks.rows(step_ids)
        return (time.process_time() - start) / calls

    same = {}
    for batch in batches:  # the same logits from the blocks as from the table (bit for bit)
        packed = packed_step(ids_by_step[0][:batch])
        a = stack.decode_packed(packed, batch, per_seq, blocks, rotary.cos_cache, rotary.sin_cache, caches)
        b = stack.decode_packed(packed, batch, per_seq, table, rotary.cos_cache, rotary.sin_cache, caches)
        same[str(batch)] = a[1] == b[1] and torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))
    out: dict[str, Any] = {"same_logits": same, "batches": {}}
    for batch in batches:
        for mode in MODES:  # warm-up
            run(mode, batch)
        rows: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]  # alternate which mode goes first
            for mode in order:
                rows[mode].append(run(mode, batch))
        medians = {mode: statistics.median(v) for mode, v in rows.items()}
        alone: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                alone[mode].append(rows_alone(mode, batch, 20 * steps))
        out["batches"][str(batch)] = {
            "rows_alone_cpu_us_median": {mode: round(1e6 * statistics.median(v), 2) for mode, v in alone.items()},
            "per_step_cpu_ms": {mode: [round(1e3 * s, 4) for s in v] for mode, v in rows.items()},
            "median_ms": {mode: round(1e3 * s, 4) for mode, s in medians.items()},
            "blocks_over_float32": round(medians["blocks"] / medians["float32"], 4),
            "torch_rows_over_float32": round(medians["torch_rows"] / medians["float32"], 4),
            "blocks_over_float32_by_round": [round(b / f, 4) for b, f in zip(rows["blocks"], rows["float32"])],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], metavar="N", help="decodes a step")
    parser.add_argument("--steps", type=int, default=64, metavar="N", help="steps a mode runs per round")
    parser.add_argument("--rounds", type=int, default=7, metavar="N", help="rounds, modes alternating")
    parser.add_argument("--context", type=int, default=64, metavar="TOKENS", help="each sequence's context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action="store_true", help="also the planner's bytes and RSS after load")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the record here")
    parser.add_argument("--child-memory", choices=("blocks", "float32"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    if args.child_memory:
        print(json.dumps(child_memory(model, args.child_memory)))
        return
    record: dict[str, Any] = {"model": str(model), "commit": git_commit(),
                              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "child_memory")}}
    record["steps"] = step_times(model, args.batch, args.steps, args.rounds, args.context, args.seed)
    record["machine"] = machine_info()
    for batch, row in record["steps"]["batches"].items():
        print(f"batch {batch}: median CPU ms/step " + ", ".join(f"{m} {v:.3f}" for m, v in row["median_ms"].items())
              + f"; blocks/float32 {row['blocks_over_float32']:.3f} (rounds: {row['blocks_over_float32_by_round']}),"
              f" torch_rows/float32 {row['torch_rows_over_float32']:.3f}")
        print(f"batch {batch}: the rows alone, median CPU us/call " + ", ".join(
            f"{m} {v:.1f}" for m, v in row["rows_alone_cpu_us_median"].items()))
    print(f"same logits and greedy tokens from the blocks as from the float32 table: {record['steps']['same_logits']}")
    if args.memory:
        record["memory"] = mem = memory(model)
        planner = mem["planner_weight_bytes"]
        print(f"planner weights: {planner['blocks'] / MiB:.1f} MiB with the embedding in its {mem['embedding_format']}"
              f" blocks, {planner['float32'] / MiB:.1f} MiB with a float32 table")
        for table, row in mem["rss"].items():
            print(f"RSS after load ({table}, {row['embedding']}): {row['rss_after_load_mib']:.0f} MiB "
                  f"({row['load_mib']:.0f} MiB above the imports)")
    if args.json:
        write_record(args.json, record)


if __name__ == "__main__":
    main()
