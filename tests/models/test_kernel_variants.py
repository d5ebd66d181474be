"""Every ISA variant of the kernels against the scalar reference, kernel by kernel, on the variants this
machine runs (each variant's library loaded side by side in this process: ``_build.variant``); and how the
variant is chosen (``ASYNCINFER_KERNEL_ISA``, in subprocesses).

Tolerances (docs/formats.md, "Kernel variants"): the variants differ only in the order of float32 sums,
fused or separate multiply-adds and exp's last bits; the int16 rounding of activations below
PANEL_MIN_ROWS rows is part of the algorithm and the same in every variant (so is activation_dtype="int8"'s
int8 rounding, with its own layer tolerance below). So the GEMM agrees within
1e-5 of the sum of |x| * |w| of each output, RMS norm and attention within 1e-5 relative, argmax exactly,
a whole layer or decode step within 1e-3 of the largest |h| (a last-bit difference may flip one int16
rounding of a later projection's input).

The AVX-512 variants' code also runs where the CPU lacks AVX-512 or VNNI (only there: "avx512-emulated",
"avx512vnni-emulated"): the same sources built with the AVX2 flags and ``-DASYNCINFER_EMULATE_AVX512`` (and
``-DASYNCINFER_EMULATE_VNNI``), which make ``csrc/internal.h`` take the AVX-512 (VNNI) branch with its 512-bit
and VNNI intrinsics emulated by SIMDe's headers (``libsimde-dev``), compiled into a temporary directory and
compared against the scalar reference by the same tests (the emulated VNNI build against the emulated AVX-512
one, bit for bit). Skipped where SIMDe's headers are missing, except under CI=true, where that fails
(``.ci/run`` installs them). The VNNI variant computes the same integers as the AVX-512 one with other
instructions, so their GEMMs agree bit for bit (tested on every build this machine runs).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncinfer import kernels
from asyncinfer.kernels import _build
from asyncinfer.kernels._variants import ISA_ENV, ISAS
from tests.models.test_int8_activations import int8_definition, minimums

#: The AVX-512 variants' code with their 512-bit intrinsics (and VNNI's) emulated (on AVX2): tested beside the
#: variants, each with the flags of its build and the variant it reports itself as.
EMULATED = "avx512-emulated"
EMULATED_VNNI = "avx512vnni-emulated"
EMULATIONS = {EMULATED: (("-DASYNCINFER_EMULATE_AVX512",), "avx512"),
              EMULATED_VNNI: (("-DASYNCINFER_EMULATE_AVX512", "-DASYNCINFER_EMULATE_VNNI"), "avx512vnni")}


def _emulations_needed() -> tuple[str, ...]:
    """The emulated builds this machine tests: one for each AVX-512 variant its CPU does not run. Where the CPU
    runs a variant, its own library runs the same code under the same tests, and the emulation would only
    repeat them through SIMDe's slow intrinsics (on other CPUs the emulation is what covers that code)."""
    runs = kernels.supported_isas() if kernels.available() else ()
    return tuple(name for name, (_, reports) in EMULATIONS.items() if reports not in runs)


#: What every test below runs on. The emulated VNNI build is left out: it is held to the emulated AVX-512 build bit
#: for bit (test_the_vnni_variant_equals_the_avx512_variant_bit_for_bit), which these tests hold to the reference,
#: so running them on it too would only repeat that work (on AVX2 machines, through slow emulation).
VARIANTS = (*ISAS, *(name for name in _emulations_needed() if name == EMULATED))
#: The pairs held bit for bit: the native ones (skipped where the CPU lacks them), the emulated ones where it does.
VNNI_PAIRS = [("avx512vnni", "avx512"), *([(EMULATED_VNNI, EMULATED)] if EMULATED_VNNI in _emulations_needed() else [])]
_emulated: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def built(tmp_path_factory: pytest.TempPathFactory) -> None:
    assert kernels.available(), kernels.unavailable_reason()
    _emulated["dir"] = tmp_path_factory.mktemp("avx512-emulated")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def has_simde(compiler: str) -> bool:
    """Whether the compiler finds SIMDe's AVX-512 header (libsimde-dev)."""
    proc = subprocess.run([compiler, "-E", "-x", "c", "-", "-o", os.devnull], input="#include <simde/x86/avx512.h>\n",
                          capture_output=True, text=True, timeout=60, check=False)
    return proc.returncode == 0


def build_emulated(name: str, directory: Path) -> ctypes.CDLL:
    """An AVX-512 variant's code (``name``, a key of EMULATIONS) built with the AVX2 flags and SIMDe's
    emulation, as the run-time build builds a variant (its helpers, torch's OpenMP runtime), into
    ``directory``; checked to report itself as that variant of this ABI version."""
    flags, reports = EMULATIONS[name]
    compiler = _build._compiler()
    assert compiler is not None  # the kernels were built (the fixture), so a compiler is there
    if not has_simde(compiler):
        message = ("SIMDe's headers (simde/x86/avx512.h, Debian's libsimde-dev) are missing: the AVX-512 "
                   "variant's code cannot be run through emulation")
        if in_ci():
            pytest.fail(message + " (.ci/run installs them)")
        pytest.skip(message)
    out = directory / f"kernels-{name}.so"
    (directory / name).mkdir(exist_ok=True)
    try:
        _build._compile_and_link(compiler, "avx2", _build._sources(), directory / name, out,
                                 _build._torch_openmp(), with_openmp=True, extra=flags)
    except RuntimeError:  # a compiler without OpenMP: one thread
        _build._compile_and_link(compiler, "avx2", _build._sources(), directory / name, out, None,
                                 with_openmp=False, extra=flags)
    lib = _build._checked(ctypes.CDLL(str(out)), reports)
    _build._configure(lib)
    assert lib.asyncinfer_panel_min_rows() == _build.PANEL_MIN_ROWS
    assert lib.asyncinfer_step_tile_min_rows() == _build.STEP_TILE_MIN_ROWS
    return lib


def runs_here(isa: str) -> None:
    if isa in EMULATIONS:
        if "avx2" not in kernels.supported_isas():  # the emulation runs on AVX2 (and x86 only)
            pytest.skip(f"the {isa} build needs a CPU that runs the avx2 variant")
        if isa not in _emulated:
            _emulated[isa] = build_emulated(isa, _emulated["dir"])
        return
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} variant")


class on:
    """The public functions on one variant's library (or an emulated AVX-512 build, once runs_here built
    it), for the length of a with block."""

    def __init__(self, isa: str) -> None:
        self.lib = _emulated[isa] if isa in EMULATIONS else _build.variant(isa)

    def __enter__(self) -> None:
        self.saved, _build._lib = _build._lib, self.lib

    def __exit__(self, *exc: object) -> None:
        _build._lib = self.saved


def random_blocks(fmt: str, rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return kernels.pack(kernels.quantize(torch.randn(rows, k, generator=gen) * 0.1, fmt), fmt)


def test_the_variants_this_cpu_runs_are_named_and_one_is_chosen() -> None:
    supported = kernels.supported_isas()
    assert supported[0] == "scalar" and set(supported) <= set(ISAS)
    assert kernels.isa() in supported
    info = kernels.build_info()
    assert info["isa"] == kernels.isa() and info["source"] in ("installed", "cache") and os.path.exists(info["path"])
    if not os.environ.get(ISA_ENV):
        assert kernels.isa() == supported[-1]  # the best this CPU runs
    for isa in supported:
        lib = _build.variant(isa)
        assert ISAS[lib.asyncinfer_kernels_isa()] == isa and lib.asyncinfer_kernels_version() == _build._VERSION
    for isa in ISAS:
        if isa not in supported:
            with pytest.raises(kernels.KernelISAError, match="this CPU runs only"):
                _build.variant(isa)


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("fmt", list(kernels.BLOCK_FORMATS))
def test_gemm_equals_the_scalar_reference(isa, fmt) -> None:
    """Widths of whole runs of 16 blocks (the AVX-512 row kernels' scales are formed 16 blocks at a time: 512 = one
    run, two k-quant super-blocks), with an odd remainder past them (800 = a run and 9 blocks) and of a remainder
    alone (96 = 3 blocks). Below PANEL_MIN_ROWS rows each row's result is also the one it has alone, bit for bit:
    every row is summed in the same order whatever the number of rows. From it on the AVX-512 variants' int16
    tile keeps the rows' int16 rounding: held to the scalar reference's rows (each row alone there), and each
    row's result is the one it has in a batch of PANEL_MIN_ROWS rows, bit for bit."""
    runs_here(isa)
    tile = isa in kernels.INT16_TILE_ISAS or isa in EMULATIONS
    n = 37
    for k in ((512,) if kernels.BLOCK_FORMATS[fmt][0] == 256 else (512, 800, 96)):
        w = random_blocks(fmt, n, k, seed=3)
        dense = kernels.dequantize(kernels.unpack(w, fmt), fmt)
        gen = torch.Generator().manual_seed(5)
        bias = torch.randn(n, generator=gen)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17, 40):
            x = torch.randn(rows, k, generator=gen)
            x[0, :32] *= 1000  # one block of large values: its int16 scale differs from the others'
            batched = rows >= kernels.PANEL_MIN_ROWS
            with on("scalar"):
                ref = torch.stack([kernels.gemm(x[r:r + 1], w, fmt, n, bias)[0] for r in range(rows)]) \
                    if batched and tile else kernels.gemm(x, w, fmt, n, bias)
            with on(isa):
                got = kernels.gemm(x, w, fmt, n, bias)
                alone = [kernels.gemm(x[r:r + 1], w, fmt, n, bias)[0] for r in range(rows)] \
                    if not batched else []
                if batched and tile:
                    first = kernels.gemm(x[-kernels.PANEL_MIN_ROWS:], w, fmt, n, bias)
                    assert torch.equal(got[-kernels.PANEL_MIN_ROWS:], first), (isa, fmt, k, rows)
            bound = 1e-5 * (x.abs() @ dense.abs().T) + 1e-6
            assert ((got - ref).abs() <= bound).all(), (isa, fmt, k, rows, (got - ref).abs().max().item())
            assert torch.allclose(ref, x @ dense.T + bias, rtol=1e-3, atol=1e-2 * x.abs().max().item())
            for r, row in enumerate(alone):
                assert torch.equal(got[r], row), (isa, fmt, k, rows, r)
    nan = torch.randn(6, k, generator=gen)
    nan[1, 7] = float("nan")
    with on(isa):
        out = kernels.gemm(nan, w, fmt, n)
    assert out[1].isnan().all() and not out[[0, 2, 3, 4, 5]].isnan().any()


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("fmt", list(kernels.BLOCK_FORMATS))
def test_the_int8_activation_gemm_equals_the_scalar_reference(isa, fmt) -> None:
    """activation_dtype="int8" (csrc/gemm8.c): every variant rounds the activations to the same int8 values and
    forms the same integer products; only the order of the float32 sums differs. Both int8 GEMMs (the AVX-512
    builds' tile; the rows, which the others take for it too). Widths with a remainder past the AVX-512 kernels'
    runs of 16 blocks (800 = 25 runs of 32) and without; row counts below, at and past the tile's 16 and 32. The
    AVX-512 builds round the k-quants' activations with a scale per 256 in both GEMMs (the scalar variant per 32):
    held to that definition in float64 (test_int8_activations.int8_definition), within the same bound."""
    runs_here(isa)
    n = 37
    k_quant = kernels.BLOCK_FORMATS[fmt][0] == 256
    for k, kernel in itertools.product((512, 1024) if k_quant else (512, 800), kernels.INT8_KERNELS):
        w = random_blocks(fmt, n, k, seed=k)
        dense = kernels.dequantize(kernels.unpack(w, fmt), fmt)
        per_256 = k_quant and (isa in kernels.INT16_TILE_ISAS or isa in EMULATIONS)
        mins = minimums(kernels.unpack(w, fmt), fmt) if per_256 else None
        gen = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=gen)
        for rows in (1, 2, 3, 4, 5, 8, 17, 33):
            x = torch.randn(rows, k, generator=gen)
            x[0, 32:64] *= 1000
            if per_256:
                ref = (int8_definition(x, dense.double(), mins, 256) + bias.double()).float()
            else:
                with on("scalar"):
                    ref = kernels.gemm(x, w, fmt, n, bias, activation_dtype="int8", int8_kernel=kernel)
            with on(isa):
                got = kernels.gemm(x, w, fmt, n, bias, activation_dtype="int8", int8_kernel=kernel)
            bound = 1e-5 * (x.abs() @ dense.abs().T) + 1e-6
            assert ((got - ref).abs() <= bound).all(), (isa, fmt, k, kernel, rows, (got - ref).abs().max().item())
    nan = torch.randn(6, 512, generator=gen)
    nan[2, 300] = float("inf")
    for kernel in kernels.INT8_KERNELS:
        with on(isa):
            out = kernels.gemm(nan, random_blocks(fmt, n, 512, seed=1), fmt, n, activation_dtype="int8",
                               int8_kernel=kernel)
        assert out[2].isnan().all() and not out[[0, 1, 3, 4, 5]].isnan().any(), kernel


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("isa", [*VARIANTS, *(name for name in _emulations_needed() if name == EMULATED_VNNI)])
def test_q4_0_in_lanes_is_the_same_on_every_variant_bit_for_bit(isa, fmt) -> None:
    """Q4_0 in lanes (kernels.pack_lanes): every variant rounds the activations to the same int8 values, forms the
    same integers and does the same float32 operations in the same order (a multiply, then a fused multiply-add, a
    block at a time): the plain C loop of the scalar and avx2 variants and the AVX-512 builds' vectors agree to the
    last bit, outliers and a row with an infinity (NaN, that row only) included; and so does the tile reading the
    lanes (``int8_kernel="tile"``: a prefill's, on the AVX-512 builds; the lanes' own GEMM elsewhere). Q4_1 in lanes
    adds each block's minimum times the activations' float32 sum, which the scalar variant adds up in another order
    than the vector ones: every variant but scalar the avx2 variant's bits, scalar within float32 rounding of them."""
    runs_here(isa)
    reference = "scalar" if fmt == "q4_0" or isa == "scalar" else "avx2"
    runs_here(reference)
    n, k = 32, 800
    blocks = kernels.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.1, fmt)
    lanes = kernels.pack_lanes(blocks, fmt)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(n, generator=gen)
    dense = kernels.dequantize(blocks, fmt)
    for rows in (1, 3, 8, 13, 40):
        x = torch.randn(rows, k, generator=gen)
        x[0, 32:64] *= 1e4
        x[-1, ::32] = 50.0
        if rows == 13:
            x[4, 100] = float("inf")
        with on(reference):
            want = kernels.gemm(x, lanes, fmt, n, bias, activation_dtype="int8", lanes=True)
        if fmt == "q4_1" and isa != "scalar":  # the scalar variant's sums: within float32 rounding
            with on("scalar"):
                scalar = kernels.gemm(x, lanes, fmt, n, bias, activation_dtype="int8", lanes=True)
            bound = 1e-5 * (x.abs() @ dense.abs().T).nan_to_num(posinf=0.0) + 1e-5
            finite = ~want.isnan()
            assert torch.equal(scalar.isnan(), want.isnan())
            assert ((scalar - want).abs()[finite] <= bound[finite]).all(), (isa, rows)
        for kernel in kernels.INT8_KERNELS:
            with on(isa):
                got = kernels.gemm(x, lanes, fmt, n, bias, activation_dtype="int8", int8_kernel=kernel, lanes=True)
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), (
                isa, kernel, rows)
            assert got[4].isnan().all() if rows == 13 else not got.isnan().any()


@pytest.mark.parametrize(("vnni", "plain"), VNNI_PAIRS)
@pytest.mark.parametrize("fmt", list(kernels.BLOCK_FORMATS))
def test_the_vnni_variant_equals_the_avx512_variant_bit_for_bit(vnni, plain, fmt) -> None:
    """VNNI's fused dot products (vpdpbusd, vpdpwssd) form the same integers as AVX-512's multiply-add pairs and
    the float32 work around them is the same: both activation dtypes, every row count, outliers that drive the
    int8 and int16 products to their largest magnitudes. The tile from 40 rows too (three groups of 16): the VNNI
    build reads Q4_K's nibbles in place, the AVX-512 one unpacks them, the same bits."""
    runs_here(plain)
    runs_here(vnni)
    n, k = 37, 1024
    w = random_blocks(fmt, n, k, seed=11)
    gen = torch.Generator().manual_seed(13)
    bias = torch.randn(n, generator=gen)
    for dtype, kernel in (*((d, "rows") for d in kernels.ACTIVATION_DTYPES), ("int8", "tile")):
        for rows in (1, 2, 3, 4, 5, 8, 9, 17) + ((40,) if kernel == "tile" else ()):
            x = torch.randn(rows, k, generator=gen)
            x[0, 32:64] *= 1e4
            x[-1, ::32] = 50.0  # one value a block at the block's largest magnitude
            with on(plain):
                want = kernels.gemm(x, w, fmt, n, bias, activation_dtype=dtype, int8_kernel=kernel)
            with on(vnni):
                got = kernels.gemm(x, w, fmt, n, bias, activation_dtype=dtype, int8_kernel=kernel)
            assert torch.equal(got, want), (vnni, fmt, dtype, kernel, rows, (got - want).abs().max().item())
            if kernel == "tile" and rows == 17:  # the tile runs here: another order of sums than the rows'
                with on(plain):
                    assert not torch.equal(want, kernels.gemm(x, w, fmt, n, bias, activation_dtype=dtype))


@pytest.mark.parametrize("isa", VARIANTS)
def test_rms_norm_attention_and_argmax_equal_the_scalar_reference(isa) -> None:
    runs_here(isa)
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(19, 200, generator=gen), torch.randn(200, generator=gen)
    q = torch.randn(3, 4, 40, generator=gen)
    k_cache, v_cache = torch.randn(6, 16, 2, 40, generator=gen), torch.randn(6, 16, 2, 40, generator=gen)
    tables = torch.tensor([[5, 1, 2], [0, 3, 4], [2, 2, 2]])
    lens = torch.tensor([37, 1, 48])
    logits = torch.randn(5, 1003, generator=gen)
    logits[1, 700] = logits[1, 3] = 50.0  # ties: the first
    logits[2, 999] = float("nan")
    out = {}
    for name in ("scalar", isa):
        with on(name):
            out[name] = (kernels.rms_norm(x, weight, 1e-5),
                         kernels.decode_attention(q, k_cache, v_cache, tables, lens, 0.2),
                         kernels.argmax(logits))
    for ref, got in zip(out["scalar"][:2], out[isa][:2]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert out[isa][2] == out["scalar"][2] == torch.argmax(logits, dim=1).tolist()


@pytest.mark.parametrize("isa", VARIANTS)
def test_the_bf16_weight_rows_are_torchs_rounding_of_the_blocks_on_every_variant(isa) -> None:
    """activation_dtype="bfloat16"'s weight rows (asyncinfer_dequantize_bf16: the float32 rebuild then a rounding in
    the scalar and AVX2 builds, straight to bfloat16 in the AVX-512 ones, with AVX-512 BF16's conversion where the
    CPU has it, integer rounding in the emulated build): each format's product equals torch's bfloat16 product of
    the blocks' values rounded by torch, bit for bit (the same product on the same bfloat16 numbers)."""
    runs_here(isa)
    gen = torch.Generator().manual_seed(17)
    for fmt in kernels.BLOCK_FORMATS:
        k = 1024 if kernels.BLOCK_FORMATS[fmt][0] == 256 else 800
        blocks = kernels.quantize(torch.randn(45, k, generator=gen) * 0.1, fmt)
        x = torch.randn(kernels.BF16_MIN_ROWS + 11, k, generator=gen)
        want = torch.mm(kernels.dequantize(blocks, fmt).bfloat16(), x.bfloat16().t()).float().t()
        with on(isa):
            got = kernels.gemm(x, kernels.pack(blocks, fmt), fmt, 45, activation_dtype="bfloat16")
        assert torch.equal(got, want), (isa, fmt)


@pytest.mark.parametrize("isa", VARIANTS)
def test_the_embedding_rows_are_dequantizes_bits_on_every_variant(isa) -> None:
    """kernels.embed_rows (the decode stack's first step) gives, on every variant, bit for bit the float32 values
    of ``dequantize`` for every block format, in ggml's order and the kernels' layout, and times a scale the
    float32 product: its products are exact, so no variant may differ at all."""
    runs_here(isa)
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([7, 0, 7, 19, 3])
    scale = 22.627417
    for fmt in kernels.BLOCK_FORMATS:
        blocks = kernels.quantize(torch.randn(20, 512, generator=gen) * 0.1, fmt)
        whole = kernels.dequantize(blocks, fmt)
        for table in (kernels.BlockTable(blocks, fmt), kernels.BlockTable(kernels.pack(blocks, fmt), fmt, packed=True),
                      whole):
            with on(isa):
                rows, scaled = kernels.embed_rows(table, ids), kernels.embed_rows(table, ids, scale)
            assert torch.equal(rows.view(torch.int32), whole[ids].view(torch.int32)), (isa, fmt)
            assert torch.equal(scaled.view(torch.int32), (whole[ids] * scale).view(torch.int32)), (isa, fmt)


def paged_step(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's paged inputs over a cache of 8 blocks of 16: each token's block table (4 blocks), its context
    length (1 to 63) and the slot of its new key (the last position of its context)."""
    tables = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(tokens)])
    lens = torch.randint(1, 64, (tokens,), generator=gen)
    slots = torch.stack([tables[t, (lens[t] - 1) // 16] * 16 + (lens[t] - 1) % 16 for t in range(tokens)])
    return tables, lens, slots


def layer_and_inputs(fmt: str, tokens: int, seed: int, activation_dtype: str = "int16"):
    gen = torch.Generator().manual_seed(seed)
    hidden, heads, kv_heads, head_dim, inter = 64, 4, 2, 16, 96

    def proj(rows: int, k: int) -> tuple:
        return fmt, random_blocks(fmt, rows, k, seed=int(torch.randint(1 << 30, (1,), generator=gen))), None

    layer = kernels.DecodeLayer(
        norm1=1 + 0.1 * torch.randn(hidden, generator=gen), norm2=1 + 0.1 * torch.randn(hidden, generator=gen),
        eps=1e-5, qkv=(fmt, proj((heads + 2 * kv_heads) * head_dim, hidden)[1],
                       torch.randn((heads + 2 * kv_heads) * head_dim, generator=gen)),
        o=proj(hidden, heads * head_dim), gate_up=proj(2 * inter, hidden), down=proj(hidden, inter),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, scale=head_dim ** -0.5,
        activation_dtype=activation_dtype)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6
    caches = [(torch.randn(8, 16, kv_heads, head_dim, generator=gen),
               torch.randn(8, 16, kv_heads, head_dim, generator=gen))]
    tables, lens, slots = paged_step(tokens, gen)
    return layer, angles.cos(), angles.sin(), caches, tables, lens, slots, gen


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_the_decoder_layer_and_stack_equal_the_scalar_reference(isa, tokens) -> None:
    runs_here(isa)
    results = {}
    for name in ("scalar", isa):
        layer, cos, sin, caches, tables, lens, slots, gen = layer_and_inputs("q4_1" if tokens != 3 else "q8_0",
                                                                             tokens, seed=tokens)
        h = torch.randn(tokens, 64, generator=gen)
        positions = torch.randint(0, 64, (tokens,), generator=gen)
        embed = torch.randn(50, 64, generator=gen)
        ids = torch.randint(0, 50, (tokens,), generator=gen)
        head = ("q8_0", random_blocks("q8_0", 50, 64, seed=9), 50)
        with on(name):
            one = layer(h.clone(), cos[positions].contiguous(), sin[positions].contiguous(), *caches[0], slots,
                        tables, lens).clone()
            stack = kernels.DecodeStack([layer], torch.ones(64), 1e-5, head)
            logits = stack(ids, embed, positions, cos, sin, caches, slots, tables, lens, logits=True)
        results[name] = (one, logits, caches[0][0].clone())
    for ref, got in zip(results["scalar"], results[isa]):
        assert (got - ref).abs().max() <= 1e-3 * ref.abs().max(), (isa, tokens, (got - ref).abs().max().item())


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("tokens", [kernels.STEP_TILE_MIN_ROWS - 1, kernels.STEP_TILE_MIN_ROWS, 33])
def test_an_int8_stack_s_head_takes_the_tile_from_step_tile_min_rows(isa, fmt, tokens) -> None:
    """With int8, a stack whose layers are in a plain block format multiplies its output projection as kernels.gemm
    does with int8_kernel="rows" below STEP_TILE_MIN_ROWS rows and "tile" from it on, bit for bit (the final-normed
    states from the same stack without a head); the two differ where the variant has the tile."""
    runs_here(isa)
    layer, cos, sin, caches, tables, lens, slots, gen = layer_and_inputs("q8_0", tokens, seed=21,
                                                                         activation_dtype="int8")
    assert not layer.in_lanes
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    embed, ids = torch.randn(50, 64, generator=gen), torch.randint(0, 50, (tokens,), generator=gen)
    head = random_blocks(fmt, 48, 64, seed=23)
    norm = 1 + 0.1 * torch.randn(64, generator=gen)
    with on(isa):
        stack = kernels.DecodeStack([layer], norm, 1e-5, (fmt, head, 48), activation_dtype="int8")
        states = kernels.DecodeStack([layer], norm, 1e-5, activation_dtype="int8")
        logits = stack(ids, embed, positions, cos, sin, [tuple(c.clone() for c in caches[0])], slots, tables, lens,
                       logits=True)
        out = states(ids, embed, positions, cos, sin, [tuple(c.clone() for c in caches[0])], slots, tables, lens)
        by = {kernel: kernels.gemm(out, head, fmt, 48, activation_dtype="int8", int8_kernel=kernel)
              for kernel in ("rows", "tile")}
    edge = tokens >= kernels.STEP_TILE_MIN_ROWS
    assert torch.equal(logits, by["tile" if edge else "rows"])
    assert torch.equal(by["rows"], by["tile"]) == (isa not in kernels.INT16_TILE_ISAS and isa not in EMULATIONS)


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("tokens", [3, kernels.STEP_TILE_MIN_ROWS + 1])
def test_an_int8_activation_layer_equals_the_scalar_reference(isa, fmt, tokens) -> None:
    """The one-call step with activation_dtype="int8" on every variant, in the rows and (from STEP_TILE_MIN_ROWS
    rows, AVX-512 variants) the tile: within 2% of the largest |h| of the scalar reference's (a last-bit difference
    of a float32 sum may move a later projection's input across an int8 rounding step, 258 times int16's), and not
    the int16 layer's result."""
    runs_here(isa)
    results = {}
    for name, dtype in (("scalar", "int8"), (isa, "int8"), ("int16", "int16")):
        layer, cos, sin, caches, tables, lens, slots, gen = layer_and_inputs(fmt, tokens, seed=11, activation_dtype=dtype)
        assert layer.activation_dtype == dtype
        h = torch.randn(tokens, 64, generator=gen)
        positions = torch.randint(0, 64, (tokens,), generator=gen)
        with on("scalar" if name == "int16" else name):
            results[name] = layer(h.clone(), cos[positions].contiguous(), sin[positions].contiguous(), *caches[0],
                                  slots, tables, lens).clone()
    ref, got = results["scalar"], results[isa]
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max(), (isa, fmt, (got - ref).abs().max().item())
    assert not torch.equal(results["int16"], ref)


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 6])
def test_a_layer_of_mixed_formats_equals_the_scalar_reference(isa, tokens) -> None:
    """Every format in one layer and its head (q/k/v three formats, one a run of rows), at batch 1 (int16
    activations) and 6 (float32 panels): each variant within float32 rounding of the scalar reference."""
    runs_here(isa)
    hidden, heads, kv_heads, head_dim, inter = 256, 4, 2, 64, 512
    results = {}
    for name in ("scalar", isa):
        gen = torch.Generator().manual_seed(tokens)
        q, kv = heads * head_dim, kv_heads * head_dim
        layer = kernels.DecodeLayer(
            norm1=torch.ones(hidden), norm2=torch.ones(hidden), eps=1e-5,
            qkv=(("q4_k", "q5_k", "q6_k"),
                 (random_blocks("q4_k", q, hidden, 1), random_blocks("q5_k", kv, hidden, 2),
                  random_blocks("q6_k", kv, hidden, 3)), torch.randn(q + 2 * kv, generator=gen)),
            o=("q4_0", random_blocks("q4_0", hidden, q, 4), None),
            gate_up=(("q5_0", "q5_1"),
                     (random_blocks("q5_0", inter, hidden, 5), random_blocks("q5_1", inter, hidden, 6)), None),
            down=("q6_k", random_blocks("q6_k", hidden, inter, 7), None),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, scale=head_dim ** -0.5)
        caches = [(torch.randn(8, 16, kv_heads, head_dim, generator=gen),
                   torch.randn(8, 16, kv_heads, head_dim, generator=gen))]
        angles = torch.rand(64, head_dim // 2, generator=gen) * 6
        tables, lens, slots = paged_step(tokens, gen)
        positions = torch.randint(0, 64, (tokens,), generator=gen)
        embed = torch.randn(50, hidden, generator=gen)
        ids = torch.randint(0, 50, (tokens,), generator=gen)
        with on(name):
            head = ("q6_k", random_blocks("q6_k", 50, hidden, 9), 50)
            stack = kernels.DecodeStack([layer], torch.ones(hidden), 1e-5, head)
            logits = stack(ids, embed, positions, angles.cos(), angles.sin(), caches, slots, tables, lens, logits=True)
        results[name] = (logits, caches[0][0].clone())
    for ref, got in zip(results["scalar"], results[isa]):
        assert (got - ref).abs().max() <= 1e-3 * ref.abs().max(), (isa, tokens, (got - ref).abs().max().item())


@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 6])
def test_a_gemma_stack_equals_the_scalar_reference(isa, tokens) -> None:
    """Gemma's parts of the layer and the stack (post-attention and post-MLP norms, GeGLU, soft-capped scores and
    logits, q/k norms, a second rope table, a sliding window, the embedding scale): each variant's tanh and exp within float32
    rounding of the scalar reference's tanhf / expf."""
    runs_here(isa)
    hidden, heads, kv_heads, head_dim, inter = 64, 4, 2, 16, 96
    results = {}
    for name in ("scalar", isa):
        gen = torch.Generator().manual_seed(100 + tokens)

        def norm() -> torch.Tensor:
            return 1 + 0.3 * torch.randn(hidden, generator=gen)  # noqa: B023 (used within the iteration)

        def layer(i: int, **gemma) -> kernels.DecodeLayer:
            q, kv = heads * head_dim, kv_heads * head_dim
            return kernels.DecodeLayer(
                norm1=norm(), norm2=norm(), post_norm1=norm(), post_norm2=norm(), eps=1e-6,
                qkv=("q8_0", random_blocks("q8_0", q + 2 * kv, hidden, 10 * i + 1), None),
                o=("q4_1", random_blocks("q4_1", hidden, q, 10 * i + 2), None),
                gate_up=("q8_0", random_blocks("q8_0", 2 * inter, hidden, 10 * i + 3), None),
                down=("q4_1", random_blocks("q4_1", hidden, inter, 10 * i + 4), None),
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, scale=24 ** -0.5,
                activation="gelu_tanh", **gemma)
        layers = [layer(0, attn_softcap=2.0, rope_table=1, q_norm=1 + 0.2 * torch.randn(head_dim, generator=gen),
                        k_norm=1 + 0.2 * torch.randn(head_dim, generator=gen)),
                  layer(1, attn_softcap=2.0, window=21)]  # a window that starts inside a block of 16
        caches = [(torch.randn(8, 16, kv_heads, head_dim, generator=gen),
                   torch.randn(8, 16, kv_heads, head_dim, generator=gen)) for _ in layers]
        angles = torch.rand(2, 64, head_dim // 2, generator=gen) * 6
        tables, lens, slots = paged_step(tokens, gen)
        positions = torch.randint(0, 64, (tokens,), generator=gen)
        embed = torch.randn(50, hidden, generator=gen)
        ids = torch.randint(0, 50, (tokens,), generator=gen)
        with on(name):
            head = ("q8_0", random_blocks("q8_0", 50, hidden, 9), 50)
            stack = kernels.DecodeStack(layers, norm(), 1e-6, head, embed_scale=hidden ** 0.5, logit_softcap=4.0)
            cos, sin = tuple(angles.cos().unbind()), tuple(angles.sin().unbind())
            logits = stack(ids, embed, positions, cos, sin, caches, slots, tables, lens, logits=True)
        assert logits.abs().max() <= 4.0  # capped
        results[name] = (logits, caches[0][0].clone(), caches[1][1].clone())
    for ref, got in zip(results["scalar"], results[isa]):
        assert (got - ref).abs().max() <= 1e-3 * ref.abs().max(), (isa, tokens, (got - ref).abs().max().item())


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "ASYNCINFER_DISABLE_KERNELS": "0", **env},
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_environment_switch_forces_a_variant_or_names_the_allowed_values() -> None:
    """ASYNCINFER_KERNEL_ISA forces a variant (case and spaces ignored); a value that names none, or one this CPU
    lacks, leaves the kernels unavailable with a reason naming the allowed values (no diagnostic raises but
    isa() / build_info(), RuntimeError), and supported_isas() still answers."""
    code = ("from asyncinfer import kernels\n"
            "print(kernels.available(), '|', kernels.unavailable_reason(), '|', *kernels.supported_isas())\n"
            "for f in (kernels.isa, kernels.build_info):\n"
            "    try:\n"
            "        print('|', f())\n"
            "    except RuntimeError as exc:\n"
            "        print('| RuntimeError', exc, isinstance(exc.__cause__, kernels.KernelISAError))\n")
    supported = " ".join(kernels.supported_isas())
    for value in ("scalar", " SCALAR "):
        proc = run(code, **{ISA_ENV: value})
        parts = [p.strip() for p in proc.stdout.split("|")]
        assert parts[:4] == ["True", "None", supported, "scalar"] and "'isa': 'scalar'" in parts[4], \
            proc.stdout + proc.stderr[-2000:]
    hint = "(allowed values: scalar, avx2, avx512, avx512vnni, case ignored; unset or empty: the best this CPU runs)"
    bad = ["sse9"] + [isa for isa in ISAS if isa not in kernels.supported_isas()]  # and a variant this CPU lacks
    for value in bad:
        proc = run(code, **{ISA_ENV: value})
        parts = [p.strip() for p in proc.stdout.split("|")]
        assert parts[0] == "False" and parts[1].startswith(f"{ISA_ENV}={value!r}") and parts[1].endswith(hint), \
            proc.stdout + proc.stderr[-2000:]
        why = "names no kernel variant" if value == "sse9" else f"this CPU runs only {supported.replace(' ', ', ')}"
        assert why in parts[1], parts[1]
        assert parts[2] == supported  # what a user needs to pick a value that works
        for part in parts[3:]:
            assert part == f"RuntimeError asyncinfer's kernels cannot run here: {parts[1]} True", part


def test_a_bad_isa_leaves_the_weight_formats_as_where_the_kernels_cannot_run() -> None:
    """Under an ASYNCINFER_KERNEL_ISA that names no variant: "auto" on a Q4_1 file falls back to float16 with
    one warning naming the reason; quantization="q4_1" is refused naming the parameter and the reason."""
    code = ("import logging, types\n"
            "from asyncinfer import InvalidParameterError\n"
            "from asyncinfer.config import EngineConfig, for_model\n"
            "said = []\n"
            "handler = logging.Handler(); handler.emit = lambda record: said.append(record.getMessage())\n"
            "logging.getLogger('asyncinfer').addHandler(handler)\n"
            "gguf = types.SimpleNamespace(native_format='q4_1')  # a Q4_1 file\n"
            "print(for_model(EngineConfig(device='cpu'), {}, gguf).quantization)\n"
            "print(sum('cannot run here' in m and \"'sse9' names no kernel variant\" in m for m in said))\n"
            "try:\n"
            "    EngineConfig(device='cpu', quantization='q4_1')\n"
            "except InvalidParameterError as exc:\n"
            "    print(exc.parameter, \"'sse9' names no kernel variant\" in str(exc))\n")
    proc = run(code, **{ISA_ENV: "sse9"})
    assert proc.stdout.split() == ["float16", "1", "quantization", "True"], proc.stdout + proc.stderr[-2000:]


def test_auto_passes_over_the_block_formats_where_only_the_scalar_reference_runs() -> None:
    """On a CPU with no vectorised variant (aarch64, x86 without AVX2: faked here by the CPU check answering
    scalar alone), quantization="auto" keeps float16 for a q4_1 file, since the plain-C reference is many
    times slower than torch's float16 kernels on a batch; q4_1 asked for by name still runs, and so does
    "auto" when ASYNCINFER_KERNEL_ISA asks for the scalar variant."""
    code = ("import torch\n"
            "from asyncinfer import kernels\n"
            "from asyncinfer.kernels import _build\n"
            "_build._cpu_isas = lambda: ('scalar',)\n"
            "from asyncinfer.models.quant import resolve_quantization\n"
            "cpu = torch.device('cpu')\n"
            "print(kernels.available(), kernels.isa(), resolve_quantization('auto', cpu, 'auto', 'q4_1'),\n"
            "      resolve_quantization('q4_1', cpu, 'auto', 'q4_1'), kernels.auto_reason())\n")
    unforced = run(code, **{ISA_ENV: ""})
    words = unforced.stdout.split(maxsplit=4)
    assert words[:4] == ["True", "scalar", "float16", "q4_1"], unforced.stdout + unforced.stderr[-2000:]
    assert "only the scalar reference" in words[4]
    forced = run(code, **{ISA_ENV: "scalar"})
    assert forced.stdout.split() == ["True", "scalar", "q4_1", "q4_1", "None"], forced.stdout + forced.stderr[-2000:]
