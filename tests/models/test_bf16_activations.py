"""``activation_dtype="bfloat16"``: the block formats' GEMMs from ``BF16_MIN_ROWS`` rows on multiply the weights
rebuilt as bfloat16 (``asyncinfer_dequantize_bf16``) by the activations rounded to bfloat16, in torch; below it,
int16's paths. From the kernel to the engine option.

The error bound the kernel tests hold it to, against float64's product of the float32 activations and the blocks'
exact values (u = 2**-9, bfloat16's unit roundoff: 8 significant bits, rounded to nearest even; S the sum of the
products' sizes, sum |x_k| |w_k|): x_k and w_k are each rounded once (a product off by at most (2u + u**2) of its
size), oneDNN adds the K exact float32 products in float32 (at most about K * 2**-24 of S, in any order) and
torch's bfloat16 product rounds the sum once to bfloat16 (u of its size, at most S (1 + 2u + u**2)); the bias is
added in float32. In all, (3u + 4u**2 + 2 K 2**-24) S + 2**-23 (S + |bias|).
"""

from __future__ import annotations

import logging

import pytest
import torch

from asyncinfer import InvalidParameterError, kernels
from asyncinfer import config as config_module
from asyncinfer.config import EngineConfig
from asyncinfer.kernels import ops
from asyncinfer.models.quant import Q4_KLinear
from tests.models.test_int8_activations import weights
from tests.models.test_kernels import lossless_tiny

U = 2.0**-9


def bound(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The module docstring's bound for ``x @ dense.T + bias``, float64."""
    k = x.shape[1]
    sizes = x.abs().double() @ dense.abs().T
    return (3 * U + 4 * U * U + 2 * k * 2.0**-24) * sizes + 2.0**-23 * (sizes + bias.abs().double())


def torch_bf16(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The product as the step defines it, built from torch alone: the blocks' float32 values rounded once to
    bfloat16 by torch, torch's bfloat16 product with x rounded to bfloat16, widened to float32, plus the bias."""
    return torch.mm(dense.float().bfloat16(), x.bfloat16().t()).float().t() + bias


@pytest.mark.parametrize("fmt", list(kernels.BLOCK_FORMATS))
def test_the_bf16_gemm_is_torchs_bf16_product_of_the_blocks_values(fmt) -> None:
    """Every format: below BF16_MIN_ROWS rows the int16 GEMM's result to the bit; from it on torch's bfloat16
    product of the blocks' values (each rounded once) to the bit, within the bound of float64's product, and not
    the int16 GEMM's (a real change of numerics)."""
    k_quant = kernels.BLOCK_FORMATS[fmt][0] == 256
    for k in ((512, 1024) if k_quant else (512, 800)):
        packed, dense, _ = weights(fmt, 45, k, seed=k)
        gen = torch.Generator().manual_seed(k + 1)
        bias = torch.randn(45, generator=gen)
        for rows in (1, 2, kernels.BF16_MIN_ROWS - 1):
            x = torch.randn(rows, k, generator=gen)
            assert torch.equal(kernels.gemm(x, packed, fmt, 45, bias, activation_dtype="bfloat16"),
                               kernels.gemm(x, packed, fmt, 45, bias))
        for rows in (kernels.BF16_MIN_ROWS, 17, 40, 200):
            x = torch.randn(rows, k, generator=gen)
            x[0, :32] *= 1000  # one run of large values
            out = kernels.gemm(x, packed, fmt, 45, bias, activation_dtype="bfloat16")
            assert out.dtype == torch.float32 and out.shape == (rows, 45) and out.is_contiguous()
            assert torch.equal(out, torch_bf16(x, dense, bias)), (fmt, k, rows)
            err = (out.double() - (x.double() @ dense.T + bias.double())).abs()
            assert (err <= bound(x, dense, bias)).all(), (fmt, k, rows, (err / bound(x, dense, bias)).max().item())
            int16 = kernels.gemm(x, packed, fmt, 45, bias)
            assert not torch.equal(out, int16)
            assert ((out - int16).norm() / int16.norm()).item() < 4 * U


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q5_0", "q6_k"])
def test_the_weights_are_rebuilt_a_slice_of_rows_at_a_time(fmt, monkeypatch) -> None:
    """A scratch of 16 rows for 45 weight rows: three slices (16, 16, 13), each in its place of the output."""
    k = 512
    packed, dense, _ = weights(fmt, 45, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    x, bias = torch.randn(64, k, generator=gen), torch.randn(45, generator=gen)
    whole = kernels.gemm(x, packed, fmt, 45, bias, activation_dtype="bfloat16")
    monkeypatch.setattr(ops, "_BF16_SLICE_BYTES", 16 * 2 * k)
    seen: list[tuple[int, ...]] = []
    mm = torch.mm

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(a.shape))
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", spy)
    sliced = kernels.gemm(x, packed, fmt, 45, bias, activation_dtype="bfloat16")
    assert seen == [(16, k), (16, k), (13, k)]
    err = (sliced.double() - (x.double() @ dense.T + bias.double())).abs()
    assert (err <= bound(x, dense, bias)).all()
    assert ((sliced - whole).norm() / whole.norm()).item() < 1e-6  # the same products, however the rows are cut


def test_a_nan_activation_makes_its_row_nan_and_only_its_row() -> None:
    packed, _, _ = weights("q4_k", 32, 512, seed=5)
    x = torch.randn(kernels.BF16_MIN_ROWS, 512, generator=torch.Generator().manual_seed(6))
    x[3, 100] = float("nan")
    out = kernels.gemm(x, packed, "q4_k", 32, activation_dtype="bfloat16")
    assert out[3].isnan().all() and not out[[i for i in range(x.shape[0]) if i != 3]].isnan().any()


def test_the_option_is_taken_everywhere_activation_dtype_is(monkeypatch) -> None:
    assert "bfloat16" in kernels.ACTIVATION_DTYPES and kernels.activation_dtype_flag("bfloat16") == 0
    assert kernels.BF16_MIN_ROWS >= kernels.PANEL_MIN_ROWS  # int16's rows below it, never its float32 panel
    layer = Q4_KLinear(torch.randn(8, 256), None, activation_dtype="bfloat16")
    assert layer.activation_dtype == "bfloat16" and "bfloat16 activations" in layer.kind
    x = torch.randn(kernels.BF16_MIN_ROWS, 256)
    packed = layer.kernel_weights()[1]
    assert torch.equal(layer(x), kernels.gemm(x, packed, "q4_k", 8, activation_dtype="bfloat16"))
    monkeypatch.setattr(config_module, "cpu_has_fast_matmul", lambda dtype: True)
    assert EngineConfig(device="cpu", activation_dtype=" BFloat16 ").activation_dtype == "bfloat16"
    for bad in ("bf16", "float32", "bfloat16x"):
        with pytest.raises(InvalidParameterError, match="activation_dtype") as info:
            EngineConfig(device="cpu", activation_dtype=bad)
        assert "bfloat16" in str(info.value)
        with pytest.raises(ValueError, match=r"activation_dtype must be one of \['int16', 'int8', 'bfloat16'\]"):
            kernels.gemm(x, packed, "q4_k", 8, activation_dtype=bad)


def test_a_cpu_without_native_bf16_matmul_is_warned_once(monkeypatch, caplog) -> None:
    """As dtype=bfloat16 is (config.warn_slow_cpu_dtype): where torch says the CPU has no native bfloat16 matrix
    kernels, one warning per process naming the option and what is faster; none where it has them, none for
    the other activation dtypes."""
    monkeypatch.setattr(config_module, "_WARNED_SLOW_BF16_ACTIVATIONS", [])
    monkeypatch.setattr(config_module, "cpu_has_fast_matmul", lambda dtype: dtype != torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        for dtype in ("int16", "int8", "bfloat16", "bfloat16"):
            EngineConfig(device="cpu", activation_dtype=dtype)
    said = [r.getMessage() for r in caplog.records if "activation_dtype" in r.getMessage()]
    assert said == [("activation_dtype='bfloat16' is slow on this CPU (it has no native bfloat16 matrix kernels, so "
                     "each product is emulated): activation_dtype='int8' (or the default 'int16') is faster "
                     "(docs/formats.md)")]
    caplog.clear()
    monkeypatch.setattr(config_module, "_WARNED_SLOW_BF16_ACTIVATIONS", [])
    monkeypatch.setattr(config_module, "cpu_has_fast_matmul", lambda dtype: True)
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        EngineConfig(device="cpu", activation_dtype="bfloat16")
    assert not [r for r in caplog.records if "activation_dtype" in r.getMessage()]


async def test_the_engine_option_runs_a_prefill_in_bf16_and_a_decode_in_int16(tmp_path, monkeypatch) -> None:
    """A prompt of 40 tokens: its prefill's projections take the bfloat16 product; the decode steps (one row) do
    not. The greedy tokens of this random tiny model (its projections exactly Q4_1 values) against float32's:
    measured equal for 7 tokens, the 8th a near-tie that bfloat16's rounding of the prefill flips; the first 4 are
    asserted (another CPU's bfloat16 sums may add in another order)."""
    from asyncinfer import AsyncEngine, SamplingParams
    from asyncinfer.models.quality import common_prefix

    lossless_tiny("llama", tmp_path)
    rows: list[int] = []
    bf16 = ops._gemm_bf16

    def spy(lib, x, *args):
        rows.append(x.shape[0])
        return bf16(lib, x, *args)

    monkeypatch.setattr(ops, "_gemm_bf16", spy)
    monkeypatch.setattr(config_module, "cpu_has_fast_matmul", lambda dtype: True)
    prompt = [(7 * i + 3) % 200 + 5 for i in range(40)]
    tokens = {}
    for dtype, quantization in (("bfloat16", "q4_1"), ("int16", None)):
        engine = await AsyncEngine.load(str(tmp_path), activation_dtype=dtype, quantization=quantization,
                                        num_threads=1)
        async with engine:
            assert engine.config.activation_dtype == dtype
            out = await engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
            tokens[dtype] = out.token_ids
        if dtype == "bfloat16":
            assert rows and set(rows) == {40}  # the prefill's every projection, and nothing else
    assert len(tokens["bfloat16"]) == 8 and common_prefix(tokens["bfloat16"], tokens["int16"]) >= 4, tokens
