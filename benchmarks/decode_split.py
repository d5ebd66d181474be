"""Where a decode step goes (one request's, or ``--requests N`` decoding together), on a model whose steps run on
asyncinfer's kernels (the block formats):
the layers' projections, attention, the rest of the layers (norms, rope, residuals, the threads' barriers) and
the LM head, as the kernels add up their own time (``DecodeStack.time_parts``), against the step timed around
``core.step()``. With the weight bytes a step reads (``peer.weight_bytes_per_token``) and a read-bandwidth
probe (``peer.read_bandwidth``), it says what share of the probe the projections alone read at: the bound on
what any change outside the row kernels can gain.

    python benchmarks/make_gguf.py /tmp/llama-1b-q4_0.gguf --shape 1b --type q4_0
    python benchmarks/decode_split.py /tmp/llama-1b-q4_0.gguf --threads 2 --json benchmarks/results/decode_split_1b_q4_0.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info, write_record
from peer import read_bandwidth, weight_bytes_per_token
from throughput import fused_layer_split

#: The most requests --requests decodes together (the engine is given room for them: max_num_seqs, the cache).
MAX_REQUESTS = 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="a GGUF file in a block format")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    p.add_argument("--requests", type=int, default=1,
                   help="requests decoding together: each step multiplies this many rows (32: a step of the peer "
                        "benchmark's 32 requests, where the int8 layers and head take the tile, not in lanes)")
    p.add_argument("--rounds", type=int, default=3, help="measurements (the median is reported)")
    p.add_argument("--probe-mib", type=int, default=1024)
    p.add_argument("--activation-dtype", default="int16", choices=["int16", "int8", "bfloat16"],
                   help="how the block formats' kernels round a step's activations (the engine option)")
    p.add_argument("--lanes", default="auto", choices=["auto", "off"],
                   help="off: Q4_0 layers keep ggml's layout with int8 activations (the engine's choice forced off, "
                        "as the tests force it), to compare with the lanes (docs/formats.md, 'Q4_0 in lanes')")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise SystemExit(f"--requests must be in [1, {MAX_REQUESTS}], got {args.requests}")
    torch.set_num_threads(args.threads)

    from asyncinfer import AsyncEngine, SamplingParams, kernels
    from asyncinfer.config import EngineConfig
    from asyncinfer.models.quant import BlockLinear
    from asyncinfer.request import Request

    if args.lanes == "off":
        kernels.lanes_native = lambda: False  # read by each Q4_0 / Q4_1 layer as it is built

    options = {"num_threads": args.threads, "max_model_len": 1024, "activation_dtype": args.activation_dtype}
    steps_needed = 8 + args.rounds * args.steps
    if args.requests > 1:  # room for every request to its last step (none waits, none preempted)
        options["max_num_seqs"] = max(args.requests, EngineConfig.max_num_seqs)
        plan = AsyncEngine.plan_memory(str(args.model), **options)
        blocks = args.requests * -(-(32 + steps_needed + 1) // plan.block_size)
        options["kv_cache_memory"] = max(blocks, plan.num_blocks) * plan.block_bytes
    engine = AsyncEngine.from_pretrained(str(args.model), **options)
    core = engine.core
    vocab = engine.model_config.vocab_size
    for r in range(args.requests):  # 32-token prompts, each its own
        core.add_request(Request(request_id=f"split{r}",
                                 prompt_token_ids=[(300 + 40 * r + i) % vocab for i in range(32)],
                                 params=SamplingParams(max_tokens=steps_needed + 1, ignore_eos=True),
                                 arrival_time=time.time()))
    for _ in range(8):  # the prompts, then a few plain decode steps
        core.step()

    def all_decoding() -> None:  # every step of a round multiplies one row a request
        running, waiting = core.queue_counts()
        if (running, waiting) != (args.requests, 0):
            raise SystemExit(f"{running} of {args.requests} requests decode ({waiting} wait): not a step of "
                             f"{args.requests} rows")

    all_decoding()
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        split = fused_layer_split(core, args.steps)
        if split is None:
            raise SystemExit(f"{args.model}: its decode steps do not run on asyncinfer's kernels (not a block format)")
        all_decoding()
        rounds.append({**split, "requests_decoding": args.requests})
    probe = read_bandwidth(args.probe_mib, 3)
    per_token = weight_bytes_per_token(args.model)
    step = statistics.median(r["step_s"] for r in rounds)
    projections = statistics.median(r["layer_projections_s"] + r["head_s"] for r in rounds)
    summary = {
        "requests": args.requests, "step_ms": step * 1e3, "tokens_per_s": args.requests / step,
        "head_ms": statistics.median(r["head_s"] for r in rounds) * 1e3,
        "projections_ms": projections * 1e3,
        "attention_ms": statistics.median(r["attention_s"] for r in rounds) * 1e3,
        "projections_share": projections / step,
        "weight_bytes_per_token": per_token, "probe_gb_s": probe,
        "step_of_probe": per_token / step / 1e9 / probe,
        "projections_of_probe": per_token / projections / 1e9 / probe,
        "activation_dtype": args.activation_dtype,
        "projections_in_lanes": sum(isinstance(m, BlockLinear) and m.lanes for m in core.runner.model.modules()),
    }
    print(f"{args.model.name}, {args.threads} threads: step {summary['step_ms']:.2f} ms ({summary['tokens_per_s']:.1f} "
          f"tok/s), projections {summary['projections_ms']:.2f} ms ({summary['projections_share']:.1%} of it), "
          f"attention {summary['attention_ms']:.2f} ms; of the projections, the head {summary['head_ms']:.2f} ms "
          f"({args.requests} row{'s' if args.requests > 1 else ''} a step)")
    tokens = f"{args.requests} token{'s' if args.requests > 1 else ''}"
    print(f"weights {per_token / 1e6:.1f} MB a step ({tokens}); read probe {probe:.1f} GB/s: the step reads at "
          f"{summary['step_of_probe']:.0%} of it, the projections alone at {summary['projections_of_probe']:.0%}")
    if args.json:
        write_record(args.json, {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "commit": git_commit(),
                                 "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
                                 "summary": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
