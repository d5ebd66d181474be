"""Trial weight layouts for Q4_0 and Q4_K (``--format``) with int8 activations, timed beside the kernels' int8 rows
and tile on the same weights: what a layout with weight rows in the vector lanes would buy, before the engine takes
it.

The trial (``benchmarks/data/interleaved_trial.c``, compiled here with the system's C compiler) stores weight
rows in groups of 16, each block of 32 weights of the 16 rows in one run of 288 bytes (as many bytes as ggml's 16
blocks): their float16 scales, then their nibbles four bytes of each row at a time, row r in 32-bit lane r. Four
int8 activations broadcast to every lane then make one ``vpdpbusd`` that adds each weight row's four products in
its own lane, so a block needs no horizontal sum and an activation row's result comes from the same operations
whatever the other rows of the call. The activations are rounded as the kernels' int8 rows round them (a scale per
32, nearest even; Q4_K's one per 256 where the trial runs its AVX-512 code, as the kernels' AVX-512 variants do): the
trial's integers are the rows', its result differs from theirs in the order of float
additions only (printed: the largest difference over the largest value), and each of its rows is checked to be
the same to the last bit alone and in the batch. Q4_K (``--format q4_k``) in a layout of the same kind: per 16
weight rows and super-block, their d and dmin, their eight sub-blocks' scales and minimums a byte each (2.8% more
bytes than ggml's, which packs them in 6 bits; the GB/s printed are of ggml's bytes), then the nibbles of each pair
of sub-blocks four bytes of each row at a time.

One GEMM call per projection of a decoder layer (q, k, v, o, gate, up, down, random weights by ``kernels.quantize``)
over ``--layers`` layers so that the weights come from memory, at M activation rows; the three kernels take turns
going first pass by pass, and each keeps the minimum (and the median) of ``--repeats`` passes. Printed per M:
milliseconds per pass, GB/s of weight bytes, and rows / trial and tile / trial time ratios (back to back in each
pass, their medians). The trial runs its AVX-512 code where the kernels run an AVX-512 variant, else plain C (a
check of the layout, not a speed comparison: said so in the output and the record).

    python benchmarks/interleaved_trial.py --shape 1b --threads 1 --tokens 1 2 4 16 32
    python benchmarks/interleaved_trial.py --shape 1b --threads 2 --json benchmarks/results/x.json
    python benchmarks/interleaved_trial.py --shape 1b --threads 2 --format q4_k
    python benchmarks/interleaved_trial.py --shape tiny --repeats 2     # a smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info, write_record
from kquant_rows import SHAPES, layer_matrices, typed_library

from asyncinfer import kernels
from asyncinfer.kernels import _build
from asyncinfer.kernels._variants import ISA_FLAGS
from asyncinfer.kernels.formats import LAYOUTS, activation_dtype_flag, int8_kernel_flag

SOURCE = Path(__file__).resolve().parent / "data" / "interleaved_trial.c"
KERNELS = ("rows", "tile", "trial")
#: The most the trial's results may differ from the int8 rows', over the largest value: float32 rounding of sums in
#: another order (a different integer, a nibble or an activation misplaced, moves them by far more).
ROUNDING_BOUND = 1e-5


def build_trial(where: Path) -> tuple[ctypes.CDLL, bool]:
    """The trial compiled for this CPU with the kernels' variant's own flags (``kernels._variants.ISA_FLAGS``: its
    AVX-512 code on an AVX-512 variant, plain C elsewhere) and, where the compiler has it, OpenMP, linked to the
    runtime torch loaded (by its path, as the kernels' run-time build links: one runtime and thread pool for the
    three kernels); and whether it has OpenMP (without it the trial runs on one thread whatever ``--threads``)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc) to build the trial with")
    flags = ["-O3", "-std=c11", "-fPIC", *ISA_FLAGS[kernels.isa()]]
    obj, out = where / "trial.o", where / "trial.so"

    def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise SystemExit(f"the C compiler {cc!r} cannot be run: {exc}") from exc

    openmp = run([cc, *flags, "-fopenmp", "-c", str(SOURCE), "-o", str(obj)]).returncode == 0
    if not openmp:
        done = run([cc, *flags, "-c", str(SOURCE), "-o", str(obj)])
        if done.returncode:
            raise SystemExit(f"the trial did not compile: {done.stderr[-2000:]}")
    runtime = _build._torch_openmp() if openmp else None
    link = [str(obj), runtime, f"-Wl,-rpath,{Path(runtime).parent}"] if runtime else [
        *(["-fopenmp"] if openmp else []), str(obj)]
    done = run([cc, "-shared", *link, "-lm", "-o", str(out)])
    if done.returncode:
        raise SystemExit(f"the trial did not link: {done.stderr[-2000:]}")
    lib = ctypes.CDLL(str(out))
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.trial_path.restype = ctypes.c_char_p
    lib.trial_pack.argtypes, lib.trial_pack.restype = [P, P, I64, I64], INT
    lib.trial_scratch_bytes.argtypes, lib.trial_scratch_bytes.restype = [I64, I64], I64
    lib.trial_gemm.argtypes, lib.trial_gemm.restype = [P, I64, I64, P, I64, P, INT, P], INT
    lib.trial_pack_q4_k.argtypes, lib.trial_pack_q4_k.restype = [P, P, I64, I64], INT
    lib.trial_scratch_bytes_q4_k.argtypes, lib.trial_scratch_bytes_q4_k.restype = [I64, I64], I64
    lib.trial_gemm_q4_k.argtypes, lib.trial_gemm_q4_k.restype = [P, I64, I64, P, I64, P, INT, P], INT
    return lib, bool(openmp)


#: Per format: the trial's packing, working memory and GEMM entries, its weights per block and its bytes per 16
#: rows' blocks (Q4_0: 16 x 18, ggml's; Q4_K: 2368, ggml's 16 x 144 = 2304 and the unpacked scales).
ENTRIES = {"q4_0": ("trial_pack", "trial_scratch_bytes", "trial_gemm", 32, 288),
           "q4_k": ("trial_pack_q4_k", "trial_scratch_bytes_q4_k", "trial_gemm_q4_k", 256, 2368)}


class Weights:
    """The layers' matrices in ``fmt``: ggml's blocks (the kernels' layout for Q4_0 and Q4_K) and the trial's
    packing of them."""

    def __init__(self, trial: ctypes.CDLL, fmt: str, shape: str, layers: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.fmt = fmt
        pack, _, _, per_block, group_bytes = ENTRIES[fmt]
        self.mats: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        for _ in range(layers):
            for n, k in layer_matrices(shape):
                w = torch.randn(n, k, generator=gen) * 0.02
                blocks = kernels.pack(kernels.quantize(w, fmt), fmt)
                if n % 16 or k % per_block:
                    raise SystemExit(f"the trial's layout cannot hold a {n} x {k} matrix (rows: a multiple of 16, "
                                     f"inputs: of {per_block})")
                packed = torch.empty(n // 16 * (k // per_block) * group_bytes, dtype=torch.uint8)
                if getattr(trial, pack)(blocks.data_ptr(), packed.data_ptr(), n, k):
                    raise SystemExit(f"the trial could not pack a {n} x {k} matrix")
                self.mats.append((blocks, packed, n, k))
        self.nbytes = sum(b.numel() for b, _, _, _ in self.mats)


def runner(kernel: str, weights_fmt: str, lib: ctypes.CDLL, trial: ctypes.CDLL, threads: int, kept: int
           ) -> Callable[[Weights, dict[int, torch.Tensor]], dict[int, torch.Tensor]]:
    """One pass of ``kernel`` over the weights: the outputs of the first ``kept`` matrices, by index."""
    code = LAYOUTS[weights_fmt].code | activation_dtype_flag("int8") | (int8_kernel_flag("tile") if kernel == "tile" else 0)
    _, scratch_bytes, gemm, _, _ = ENTRIES[weights_fmt]
    scratch: dict[tuple[int, int], torch.Tensor] = {}

    def run(weights: Weights, xs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        outs = {}
        for i, (blocks, packed, n, k) in enumerate(weights.mats):
            x = xs[k]
            m = x.shape[0]
            if (m, k) not in scratch:
                size = getattr(trial, scratch_bytes)(m, k) if kernel == "trial" else lib.asyncinfer_scratch_bytes(m, k)
                scratch[m, k] = torch.empty(size, dtype=torch.uint8)
            y = torch.empty(m, n)
            if kernel == "trial":
                rc = getattr(trial, gemm)(x.data_ptr(), m, k, packed.data_ptr(), n, y.data_ptr(), threads,
                                          scratch[m, k].data_ptr())
            else:
                rc = lib.asyncinfer_gemm(code, x.data_ptr(), m, k, k, blocks.data_ptr(), n, None, y.data_ptr(), n,
                                         threads, scratch[m, k].data_ptr())
            if rc:
                raise RuntimeError(f"the {kernel} GEMM failed ({rc})")
            if i < kept:
                outs[i] = y
        return outs

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--layers", type=int, default=2, help="layers of distinct weights per pass (default 2)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 16, 32])
    ap.add_argument("--repeats", type=int, default=7, help="passes per kernel and M; the minimum is kept")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--format", choices=sorted(ENTRIES), default="q4_0", help="the weights' format (default q4_0)")
    ap.add_argument("--json", type=Path, default=None, help="write every pass's time and the summaries here")
    args = ap.parse_args()
    if args.layers < 1 or args.repeats < 1 or args.threads < 1 or min(args.tokens) < 1:
        ap.error("--layers, --repeats, --threads and every --tokens value must be at least 1")
    args.tokens = list(dict.fromkeys(args.tokens))  # each M once
    if args.json is not None and (args.json.is_dir() or any(p.exists() and not p.is_dir() for p in args.json.parents)):
        ap.error(f"--json {args.json}: not a file path whose directories exist or can be made (checked before the run)")
    if not kernels.available():
        raise SystemExit(f"the kernels cannot run here: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        trial, openmp = build_trial(Path(tmp))
        path = trial.trial_path().decode()
        lib = typed_library(kernels.build_info()["path"])
        weights = Weights(trial, args.format, args.shape, args.layers, seed=1)
        kept = len(layer_matrices(args.shape))  # the first layer's outputs are checked
        runs = {kernel: runner(kernel, args.format, lib, trial, args.threads, kept) for kernel in KERNELS}
        widths = sorted({k for _, k in layer_matrices(args.shape)})
        passes: dict[tuple[str, int], list[float]] = {}
        checks = []
        with torch.inference_mode():
            for m in args.tokens:
                gen = torch.Generator().manual_seed(m)
                xs = {k: torch.randn(m, k, generator=gen) for k in widths}
                outs = {kernel: run(weights, xs) for kernel, run in runs.items()}  # (also the warm-up)
                checks.append(check(m, outs, runs["trial"], weights, xs))
                for rep in range(args.repeats):
                    order = KERNELS[rep % 3:] + KERNELS[:rep % 3]
                    for kernel in order:
                        start = time.perf_counter()
                        runs[kernel](weights, xs)
                        passes.setdefault((kernel, m), []).append(time.perf_counter() - start)
    report(args, path, openmp, weights, passes, checks)


def check(m: int, outs: dict[str, dict[int, torch.Tensor]], trial: Callable[..., dict[int, torch.Tensor]],
          weights: Weights, xs: dict[int, torch.Tensor]) -> dict[str, object]:
    """The trial against the rows (the largest difference over the largest value, per matrix of the first layer:
    the same integers leave float32 rounding only, refused past :data:`ROUNDING_BOUND`), and each of its rows alone
    against the batch's, to the last bit (refused otherwise)."""
    worst = max(float((outs["trial"][i] - outs["rows"][i]).abs().max() / outs["rows"][i].abs().max().clamp_min(1e-30))
                for i in outs["rows"])
    if not worst <= ROUNDING_BOUND:
        raise SystemExit(f"the trial is {worst:.2e} of the largest value from the rows at M={m}: more than float32 "
                         f"rounding ({ROUNDING_BOUND:g}); its integers are not the rows'")
    alone = {}
    for row in range(m):
        single = trial(weights, {k: x[row:row + 1].contiguous() for k, x in xs.items()})
        alone[row] = all(torch.equal(single[i][0], outs["trial"][i][row]) for i in single)
    if not all(alone.values()):
        raise SystemExit(f"the trial's rows depend on the batch at M={m}: rows {[r for r, ok in alone.items() if not ok]}")
    return {"tokens": m, "largest_difference_over_largest_value_vs_rows": worst,
            "rows_alone_equal_to_the_last_bit": sorted(alone)}


def report(args: argparse.Namespace, path: str, openmp: bool, weights: Weights,
           passes: dict[tuple[str, int], list[float]], checks: list[dict[str, object]]) -> None:
    one_thread = args.threads > 1 and not openmp
    speed = path != "scalar" and kernels.isa().startswith("avx512") and not one_thread and args.shape != "tiny"
    why = (" (plain C: a check, not a speed comparison)" if path == "scalar" else
           " without OpenMP (one thread: not a speed comparison)" if one_thread else
           " (the tiny shape's weights stay in cache: a smoke run, not a speed comparison)" if args.shape == "tiny" else "")
    print(f"kernels {kernels.isa()}, trial built as {path}{why}"
          f", shape {args.shape} x {args.layers} layers ({weights.nbytes / 1e6:.1f} MB of {args.format.upper()}), {args.threads} "
          f"thread(s), min of {args.repeats} passes")
    print(f"{'M':>4}" + "".join(f"{k + ' ms':>12}{'GB/s':>7}" for k in KERNELS) + f"{'rows/trial':>12}{'tile/trial':>12}"
          + f"{'max diff':>10}")
    ratios = []
    for c in checks:
        m = int(c["tokens"])
        cells = "".join(f"{min(passes[k, m]) * 1e3:12.3f}{weights.nbytes / min(passes[k, m]) / 1e9:7.1f}" for k in KERNELS)
        pair = {other: statistics.median(o / t for o, t in zip(passes[other, m], passes["trial", m]))
                for other in ("rows", "tile")}
        ratios.append({"tokens": m, **{f"{other}_over_trial_median": round(v, 4) for other, v in pair.items()}})
        print(f"{m:>4}{cells}{pair['rows']:12.2f}{pair['tile']:12.2f}"
              f"{float(c['largest_difference_over_largest_value_vs_rows']):10.1e}")
    if args.json is not None:
        write_record(args.json, {
            "command": "python benchmarks/interleaved_trial.py " + " ".join(sys.argv[1:]),
            "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "load_average_after": os.getloadavg(), "kernel_isa": kernels.isa(),
            "trial_built_as": path, "trial_openmp": openmp, "speed_comparison": speed, "format": args.format,
            "trial_bytes_over_ggml": ENTRIES[args.format][4] / (16 * LAYOUTS[args.format].nbytes), "shape": args.shape, "layers": args.layers,
            "threads": args.threads, "repeats": args.repeats, "weight_bytes": weights.nbytes,
            "what": f"seconds of one pass of one GEMM call per projection over the layers, {args.format.upper()} with int8 "
                    "activations: the kernels' rows and tile and the trial layout, taking turns pass by pass",
            "passes": [{"kernel": k, "tokens": m, "seconds": [round(t, 6) for t in times], "min_s": min(times),
                        "median_s": statistics.median(times),
                        "median_gb_per_s": round(weights.nbytes / statistics.median(times) / 1e9, 3)}
                       for (k, m), times in passes.items()],
            "ratios": ratios, "checks": checks,
        })


if __name__ == "__main__":
    main()
