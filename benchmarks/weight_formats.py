"""Speed of each weight format on the model's projection stack (the matmuls alone), on this CPU.

Builds the default model's decoder (random weights of its real shapes; speed does not depend
on the values), puts its projections in each format with the engine's own
``apply_weight_format``, and times one pass over all of them (per layer q/k/v, o, gate/up,
down, then the LM head) at M tokens: tokens/s = M / the median time of ``--repeats`` passes
after a warm-up. Each layer has its own weights, so nothing stays in cache between layers. The
header and the JSON (``kernel_isa``) name the kernels' variant (``ASYNCINFER_KERNEL_ISA`` picks another).

    python benchmarks/weight_formats.py --json benchmarks/results/weight_formats.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info

from asyncinfer import kernels
from asyncinfer.memory import read_model_config
from asyncinfer.model_source import resolve_model
from asyncinfer.models.quant import apply_weight_format, default_skip
from asyncinfer.models.registry import model_family

#: (name, quantization, quantization_skip, pack): the engine's option values.
FORMATS: tuple[tuple[str, str | None, tuple[str, ...], bool], ...] = (
    ("float32 plain (F.linear)", None, (), False),
    ("float32 packed (oneDNN)", None, (), True),
    ("float16 (fbgemm)", "float16", (), True),
    ("int8, default skip, skipped packed", "int8", default_skip("int8"), True),
    ("int8, default skip, skipped plain", "int8", default_skip("int8"), False),
    ("int8, no skip", "int8", (), True),
    ("q8_0 (asyncinfer's kernels)", "q8_0", (), True),
    ("q4_1, head q8_0 (asyncinfer's kernels)", "q4_1", (), True),
    ("q4_0, head q8_0 (asyncinfer's kernels)", "q4_0", (), True),
    ("q5_0, head q8_0 (asyncinfer's kernels)", "q5_0", (), True),
    ("q5_1, head q8_0 (asyncinfer's kernels)", "q5_1", (), True),
    # k-quants: a projection whose input size is not a multiple of 256 takes llama.cpp's fallback.
    ("q4_k (fallback q5_0), head q6_k/q8_0", "q4_k", (), True),
    ("q5_k (fallback q5_1), head q6_k/q8_0", "q5_k", (), True),
    ("q6_k (fallback q8_0), head q6_k/q8_0", "q6_k", (), True),
)


def projection_pass(model: torch.nn.Module, inputs: dict[int, torch.Tensor]) -> None:
    """Every projection once, in the decoder's order, on inputs of its width."""
    for layer in model.layers:
        layer.attn.qkv_proj(inputs[layer.attn.q_size])
        layer.attn.o_proj(inputs[layer.attn.q_size])
        layer.mlp.gate_up_proj(inputs[model.config.hidden_size])
        layer.mlp.down_proj(inputs[model.config.intermediate_size])
    model.compute_logits(inputs[model.config.hidden_size])


def time_pass(model: torch.nn.Module, m: int, repeats: int) -> float:
    cfg = model.config
    gen = torch.Generator().manual_seed(m)
    inputs = {k: torch.randn(m, k, generator=gen) for k in {cfg.hidden_size, cfg.q_size, cfg.intermediate_size}}
    times = []
    with torch.inference_mode():
        projection_pass(model, inputs)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            projection_pass(model, inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--formats", nargs="+", default=None,
                    help="only the formats whose quantization value is one of these (none: every format; "
                         "'none' for float32)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = read_model_config(resolve_model(args.model))
    torch.manual_seed(0)
    base = model_family(cfg.architecture).model_class(cfg).eval()
    rows = []
    kernel_isa = kernels.isa() if kernels.available() else None  # ASYNCINFER_KERNEL_ISA picks another variant
    kernels_line = kernel_isa or f"unavailable ({kernels.unavailable_reason()})"
    print(f"{cfg.num_layers} layers, {args.threads} threads, kernels: {kernels_line}; tokens/s of the projection "
          f"stack (median of {args.repeats})")
    print(f"{'format':<40}" + "".join(f"{'M=' + str(m):>10}" for m in args.tokens))
    for name, method, skip, pack in FORMATS:
        if args.formats is not None and str(method).lower() not in args.formats:
            continue
        model = copy.deepcopy(base)
        apply_weight_format(model, method, skip, pack=pack)
        tps = {m: m / time_pass(model, m, args.repeats) for m in args.tokens}
        del model
        rows.append({"format": name, "quantization": method, "quantization_skip": list(skip), "pack_weights": pack,
                     "tokens_per_s": {str(m): round(v, 1) for m, v in tps.items()}})
        print(f"{name:<40}" + "".join(f"{v:>10.1f}" for v in tps.values()), flush=True)
    if args.json:
        meta = {"command": "python benchmarks/weight_formats.py " + " ".join(sys.argv[1:]),
                "date": datetime.date.today().isoformat(), "machine": machine_info(),
                "load_average_after": os.getloadavg(), "model": cfg.architecture, "kernel_isa": kernel_isa,
                "what": "tokens/s of the matmuls alone: every projection of the decoder and the LM head, M tokens"}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
