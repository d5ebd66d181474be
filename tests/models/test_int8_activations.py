"""``activation_dtype="int8"``: the block formats' GEMMs with activations rounded per run of 32 to int8
(csrc/gemm8.c), from the kernel to the engine option.

The kernel's definition, checked here against float64: below PANEL_MIN_ROWS rows each run of 32 activations x
(of 256 for the k-quants on the AVX-512 builds, as llama.cpp's Q8_K) becomes dx * qx (dx = the run's largest |x| /
127, qx rounded to nearest even); a weight's part scale * q meets
qx, a format's minimum meets the run's float32 sum of x. So at every number of rows (prefills and batched decodes
too, in passes over the weights), and a row's result never depends on the other rows of the call. The variants against the scalar reference: tests/models/test_kernel_variants.py.
"""

from __future__ import annotations

import pytest
import torch

from asyncinfer import InvalidParameterError, kernels
from asyncinfer.config import EngineConfig
from asyncinfer.models import load_model
from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend, SdpaBackend
from asyncinfer.models.decode_backends import KernelDecode, TorchDecode
from asyncinfer.models.quant import BlockLinear, MixedBlockLinear, Q4_KLinear, Q6_KLinear, apply_weight_format
from tests.helpers import PagedRunner
from tests.models.test_kernels import lossless_tiny

#: Where each format with a minimum keeps its quants in ggml's block (bytes from there to the block's end):
#: zeroed, a block dequantizes to its minimums alone.
QUANTS_FROM = {"q4_1": 4, "q5_1": 4, "q4_k": 16, "q5_k": 16}

#: The variants whose build has the int8 tile (kernels.gemm's int8_kernel="tile"; the rows elsewhere): the AVX-512
#: builds, which hold the int16 tile too.
TILE8_ISAS = kernels.INT16_TILE_ISAS


def minimums(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float64 values of the minimums of ``blocks`` (ggml's blocks in ``fmt``): zeros where it has none."""
    if fmt not in QUANTS_FROM:
        return torch.zeros_like(kernels.dequantize(blocks, fmt), dtype=torch.float64)
    zeroed = blocks.clone().view(blocks.shape[0], -1, kernels.BLOCK_FORMATS[fmt][1])
    zeroed[:, :, QUANTS_FROM[fmt]:] = 0
    return kernels.dequantize(zeroed.view(blocks.shape[0], -1), fmt).double()


def weights(fmt: str, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random weights in ``fmt``: the kernels' blocks, their float64 values and their minimums' float64 values."""
    gen = torch.Generator().manual_seed(seed)
    blocks = kernels.quantize(torch.randn(rows, k, generator=gen) * 0.1, fmt)
    return kernels.pack(blocks, fmt), kernels.dequantize(blocks, fmt).double(), minimums(blocks, fmt)


def int8_definition(x: torch.Tensor, dense: torch.Tensor, mins: torch.Tensor, run: int = 32) -> torch.Tensor:
    """The kernel's result in float64: the activations rounded to int8 with a scale per ``run`` of them (the AVX-512
    builds' k-quants: 256) times the weights less their minimums, plus the float32 activations times the minimums."""
    runs = x.reshape(x.shape[0], -1, run)
    amax = runs.abs().amax(-1, keepdim=True)
    scale = 127.0 / amax  # float32, as the kernel computes it
    q = torch.where(amax > 0, (runs * torch.where(amax > 0, scale, 0)).round(), 0)  # round: to nearest even
    rounded = (q.double() * (amax.double() / 127.0).float().double()).reshape(x.shape)
    return rounded @ (dense - mins).T + x.double() @ mins.T


@pytest.mark.parametrize("kernel", kernels.INT8_KERNELS)
@pytest.mark.parametrize("fmt", list(kernels.BLOCK_FORMATS))
def test_the_int8_gemm_is_its_definition_within_float32_sums(fmt, kernel) -> None:
    """Every format, 1 to 8 rows (the row kernels, in groups of up to 4), widths with and without a remainder
    of the AVX-512 kernels' 16 runs: within float32's rounding of the definition's sums; a row's result the
    same alone and in a group. From PANEL_MIN_ROWS rows on the same definition (not the int16 option's float32
    panel), each row equal to itself alone, across passes over the weights too (1200 rows at K=512: over the
    1116 rows of int8 values a pass of the rows holds; 4200 rows, over the 4096 of the tile's). Both int8 GEMMs
    (``int8_kernel``)."""
    k_quant = kernels.BLOCK_FORMATS[fmt][0] == 256
    run = 256 if k_quant and kernels.isa() in TILE8_ISAS else 32  # the AVX-512 builds' k-quants: per 256, both GEMMs
    for k in ((512, 1024) if k_quant else (512, 800)):
        packed, dense, mins = weights(fmt, 45, k, seed=k)
        gen = torch.Generator().manual_seed(k + 1)
        bias = torch.randn(45, generator=gen)
        for rows in (1, 2, 3, 4, 5, 8):
            x = torch.randn(rows, k, generator=gen)
            x[0, :32] *= 1000  # one run of large values: its own scale
            out = kernels.gemm(x, packed, fmt, 45, bias, activation_dtype="int8", int8_kernel=kernel)
            ref = int8_definition(x, dense, mins, run) + bias.double()
            bound = 1e-5 * (x.abs().double() @ dense.abs().T) + 1e-6
            assert ((out.double() - ref).abs() <= bound).all(), (fmt, k, rows, (out.double() - ref).abs().max().item())
            alone = kernels.gemm(x[rows - 1:], packed, fmt, 45, bias, activation_dtype="int8", int8_kernel=kernel)
            assert torch.equal(out[rows - 1:], alone)
        for rows in (kernels.PANEL_MIN_ROWS, 20) + ((1200,) if k == 512 else ()):
            x = torch.randn(rows, k, generator=gen)
            x[rows - 1, :32] *= 1000
            out = kernels.gemm(x, packed, fmt, 45, bias, activation_dtype="int8", int8_kernel=kernel)
            ref = int8_definition(x, dense, mins, run) + bias.double()
            bound = 1e-5 * (x.abs().double() @ dense.abs().T) + 1e-6
            assert ((out.double() - ref).abs() <= bound).all(), (fmt, k, rows, (out.double() - ref).abs().max().item())
            assert not torch.equal(out, kernels.gemm(x, packed, fmt, 45, bias))  # not the float32 panel
            for i in (0, rows // 2, rows - 1):
                assert torch.equal(out[i], kernels.gemm(x[i : i + 1], packed, fmt, 45, bias, activation_dtype="int8", int8_kernel=kernel)[0])
        if k == 512:  # the tile's second pass: its rows the same as alone
            x = torch.randn(4200, k, generator=gen)
            out = kernels.gemm(x, packed, fmt, 45, bias, activation_dtype="int8", int8_kernel=kernel)
            for i in (0, 4095, 4096, 4199):
                assert torch.equal(out[i], kernels.gemm(x[i : i + 1], packed, fmt, 45, bias, activation_dtype="int8", int8_kernel=kernel)[0])


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_int8_activations_round_more_than_int16_and_keep_nans(fmt) -> None:
    """int8 activations are a real change of numerics (about 1% of a product, against int16's 0.01%), and a
    NaN activation makes its row NaN and only its row, as with int16."""
    packed, dense, _ = weights(fmt, 64, 512, seed=9)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ dense.T
    err = {dtype: ((kernels.gemm(x, packed, fmt, 64, activation_dtype=dtype).double() - exact).norm() / exact.norm()).item()
           for dtype in kernels.ACTIVATION_DTYPES}
    assert err["int16"] < 2e-4 and 1e-3 < err["int8"] < 3e-2, err
    x[1, 100] = float("nan")
    out = kernels.gemm(x, packed, fmt, 64, activation_dtype="int8")
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()


def test_a_bad_activation_dtype_is_refused_by_name_everywhere() -> None:
    packed, _, _ = weights("q4_k", 8, 256, seed=1)
    x = torch.randn(1, 256)
    for bad in ("int4", "INT8", None, 8, ["int8"]):
        with pytest.raises(ValueError, match=r"activation_dtype must be one of \['int16', 'int8', 'bfloat16'\]"):
            kernels.gemm(x, packed, "q4_k", 8, activation_dtype=bad)
        with pytest.raises(ValueError, match="activation_dtype must be one of"):
            Q4_KLinear(torch.randn(8, 256), None, activation_dtype=bad)
        if bad == "INT8":  # the engine option is read in any case, as format names are; the kernels' own is exact
            assert EngineConfig(device="cpu", activation_dtype=bad).activation_dtype == "int8"
            continue
        with pytest.raises(InvalidParameterError, match="activation_dtype") as info:
            EngineConfig(device="cpu", activation_dtype=bad)
        assert info.value.parameter == "activation_dtype"

    class Sneaky(str):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    assert kernels.activation_dtype_flag(Sneaky("int16")) == 0  # the str it holds, not its __eq__
    with pytest.raises(ValueError, match="activation_dtype"):
        kernels.activation_dtype_flag(Sneaky("int4"))


def test_the_layers_take_the_tile_and_the_output_projection_the_rows(tmp_path) -> None:
    """A decoder layer's projections (q/k/v, o, gate/up, down) meet every token of a prefill: the tile; the output projection a row per
    sampled request: the rows (kernels.INT8_KERNELS). A bad int8_kernel is refused by name, with int16 too."""
    lossless_tiny("llama", tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu").model
    apply_weight_format(model, "q4_1", activation_dtype="int8")
    head = model.output_proj
    assert isinstance(head, BlockLinear) and head.int8_kernel == "rows"
    layers = [m for m in model.modules() if isinstance(m, BlockLinear) and m is not head]
    assert len(layers) == 4 * model.config.num_layers and all(m.int8_kernel == "tile" for m in layers)
    packed, _, _ = weights("q4_k", 8, 256, seed=1)
    x = torch.randn(40, 256)
    for kernel in kernels.INT8_KERNELS:  # the layer's GEMM is kernels.gemm's of its kernel
        layer = Q4_KLinear.from_blocks(kernels.unpack(packed, "q4_k"), None, activation_dtype="int8", int8_kernel=kernel)
        assert torch.equal(layer(x), kernels.gemm(x, packed, "q4_k", 8, activation_dtype="int8", int8_kernel=kernel))
    for bad in ("panel", "TILE", None, 1):
        for dtype in kernels.ACTIVATION_DTYPES:
            with pytest.raises(ValueError, match=r"int8_kernel must be one of \['rows', 'tile'\]"):
                kernels.gemm(x, packed, "q4_k", 8, activation_dtype=dtype, int8_kernel=bad)
        with pytest.raises(ValueError, match="int8_kernel must be one of"):
            Q4_KLinear(torch.randn(8, 256), None, activation_dtype="int8", int8_kernel=bad)


def test_a_mixed_projection_takes_one_activation_dtype() -> None:
    w = torch.randn(16, 256)
    with pytest.raises(ValueError, match="parts\\[1\\] takes int16 activations, parts\\[0\\] int8"):
        MixedBlockLinear([Q4_KLinear(w, None, activation_dtype="int8"), Q6_KLinear(w, None)])
    mixed = MixedBlockLinear([Q4_KLinear(w, None, activation_dtype="int8"), Q6_KLinear(w, None, activation_dtype="int8")])
    assert mixed.activation_dtype == "int8" and "int8 activations" in mixed.kind


def test_the_kernel_decode_step_takes_the_models_activation_dtype(tmp_path) -> None:
    """A model formatted with int8 activations: every projection and the head hold it, and so do the kernels'
    layers and head its one-call decode steps (KernelDecode) run; their logits are the op-by-op reference's
    (TorchDecode, the same int8 GEMMs) within what a last bit's rounding flip moves, and not the int16 model's."""
    lossless_tiny("qwen2", tmp_path)
    cpu = torch.device("cpu")
    models = {}
    for dtype in kernels.ACTIVATION_DTYPES:
        model = load_model(tmp_path, torch.float32, "cpu").model
        apply_weight_format(model, "q4_1", activation_dtype=dtype)
        layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
        assert layers and all(layer.activation_dtype == dtype for layer in layers)
        models[dtype] = model
    logits = {}
    for dtype, model in models.items():
        kernel, reference = KernelDecode(model, KernelDecodeSdpaBackend(), cpu), TorchDecode(model, SdpaBackend(), cpu)
        fused, plain = PagedRunner(model, seed=1), PagedRunner(model, seed=1)
        work = [(1, list(range(3, 12))), (2, list(range(5, 9)))]
        first = kernel.forward(fused.step_batch(work, last_only=True), fused.kv_caches)
        reference.forward(plain.step_batch(work, last_only=True), plain.kv_caches)
        last = first.logits.argmax(dim=-1).tolist()
        for _ in range(4):
            step = [(s, [t]) for s, t in zip((1, 2), last)]
            a = kernel.forward(fused.step_batch(step), fused.kv_caches)
            b = reference.forward(plain.step_batch(step), plain.kv_caches)
            # the two paths' float32 sums differ in their last bits, and a last bit can move an activation across a
            # rounding step: int8's steps are 258x int16's (measured: 1e-2 against 1e-4 of the logits' norm)
            assert ((a.logits - b.logits).norm() / b.logits.norm()).item() < (3e-2 if dtype == "int8" else 1e-3)
            assert a.greedy_ids == a.logits.argmax(dim=-1).tolist()
            last = a.greedy_ids
        stack = kernel.stack
        assert stack.activation_dtype == dtype and all(layer.activation_dtype == dtype for layer in stack.layers)
        logits[dtype] = a.logits
    assert ((logits["int8"] - logits["int16"]).norm() / logits["int16"].norm()).item() > 1e-3
    assert not torch.allclose(logits["int8"], logits["int16"], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="activation_dtype"):
        apply_weight_format(load_model(tmp_path, torch.float32, "cpu").model, "q4_1", activation_dtype="int4")


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_a_decode_step_takes_the_tile_from_step_tile_min_rows(tmp_path, monkeypatch, fmt) -> None:
    """With int8 the kernels' decode step multiplies a layer's projections in a plain block format (here Q4_0 kept out
    of lanes, and Q8_0) by the rows below kernels.STEP_TILE_MIN_ROWS rows and by the tile from it on (the AVX-512
    variants; the rows elsewhere), and the output projection too (no layer is held in lanes): one request's logits are the
    same bits alone and beside STEP_TILE_MIN_ROWS - 2 others, the same beside STEP_TILE_MIN_ROWS - 1 others as beside
    40, and (where the build has the tile) the two pairs differ in their last bits; all within the op-by-op
    reference's reach of a rounding flip."""
    monkeypatch.setattr(kernels, "lanes_native", lambda: False)
    lossless_tiny("qwen2", tmp_path)
    model = load_model(tmp_path, torch.float32, "cpu").model
    apply_weight_format(model, fmt, activation_dtype="int8")
    assert not any(m.lanes for m in model.modules() if isinstance(m, BlockLinear))
    cpu = torch.device("cpu")
    kernel, reference = KernelDecode(model, KernelDecodeSdpaBackend(), cpu), TorchDecode(model, SdpaBackend(), cpu)
    tile_flag = kernels.int8_kernel_flag("tile")
    assert all(part.fmt & tile_flag for layer in kernel.stack.layers for part in layer._struct.qkv if part.rows)
    assert not any(layer.in_lanes for layer in kernel.stack.layers)
    assert kernel.stack._head_code & tile_flag  # the head as the layers: the tile from STEP_TILE_MIN_ROWS rows
    prompt = list(range(3, 14))
    edge = kernels.STEP_TILE_MIN_ROWS
    crowds = {rows: [(s, [(7 * s + j) % 250 + 3 for j in range(5 + s % 17)]) for s in range(2, rows + 1)]
              for rows in (1, edge - 1, edge, 41)}  # the request's step rows: alone, the rows' most, the tile's least
    runners = {rows: PagedRunner(model, num_blocks=640, seed=rows) for rows in crowds}
    plain = PagedRunner(model, seed=1)
    first = {rows: kernel.forward(runners[rows].step_batch([(1, prompt), *others], last_only=True),
                                  runners[rows].kv_caches) for rows, others in crowds.items()}
    reference.forward(plain.step_batch([(1, prompt)], last_only=True), plain.kv_caches)
    last = int(first[1].logits[0].argmax())
    theirs = {rows: [t[-1] for _, t in others] for rows, others in crowds.items()}
    tile_here = kernels.isa() in TILE8_ISAS
    for _ in range(3):
        out = {}
        for rows, others in crowds.items():
            step = [(1, [last]), *((s, [t]) for (s, _), t in zip(others, theirs[rows]))]
            out[rows] = kernel.forward(runners[rows].step_batch(step), runners[rows].kv_caches)
            assert out[rows].logits.shape[0] == rows
            theirs[rows] = out[rows].greedy_ids[1:]
        r = reference.forward(plain.step_batch([(1, [last])]), plain.kv_caches)
        mine = {rows: o.logits[0] for rows, o in out.items()}
        assert torch.equal(mine[1], mine[edge - 1])  # the rows
        assert torch.equal(mine[edge], mine[41])  # the tile (the rows where the build has none)
        assert torch.equal(mine[1], mine[edge]) != tile_here
        for rows in crowds:
            assert ((mine[rows] - r.logits[0]).norm() / r.logits[0].norm()).item() < 3e-2
        last = out[1].greedy_ids[0]


async def test_the_engine_option_reaches_every_projection(tmp_path) -> None:
    from asyncinfer import AsyncEngine, SamplingParams

    lossless_tiny("llama", tmp_path)
    engine = await AsyncEngine.load(str(tmp_path), activation_dtype="int8", quantization="q4_1", num_threads=1)
    async with engine:
        assert engine.config.activation_dtype == "int8"
        out = await engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out.token_ids) == 6


async def test_int8_activations_without_a_block_format_say_they_do_nothing(tmp_path, caplog) -> None:
    """float16 weights take no activation_dtype: the load says so once, naming the option and the format."""
    import logging

    from asyncinfer import AsyncEngine

    lossless_tiny("llama", tmp_path)
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        engine = await AsyncEngine.load(str(tmp_path), activation_dtype="int8", quantization="float16", num_threads=1)
        async with engine:
            pass
    said = [r.getMessage() for r in caplog.records if "activation_dtype" in r.getMessage()]
    assert said == [("activation_dtype='int8' has no effect: no projection is in a block format (quantization="
                     "'float16'); only asyncinfer's block-format kernels round activations (docs/formats.md)")]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        engine = await AsyncEngine.load(str(tmp_path), activation_dtype="int8", quantization="q4_1", num_threads=1)
        async with engine:
            pass
    assert not [r for r in caplog.records if "activation_dtype" in r.getMessage()]
