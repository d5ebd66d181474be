"""The MLPs' activations computed in place (asyncinfer.models.layers.silu_mul, gemma.gelu_tanh_mul): the values of
the plain formulas to the last bit, in every dtype and thread count, at any width; gate_up's up half untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncinfer.models.gemma import gelu_tanh_mul
from asyncinfer.models.layers import SwiGLUMLP, silu_mul, silu_mul_new

SHAPES = [(1, 8), (7, 11), (33, 1536), (300, 37), (1024, 2048)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_in_place_activations_equal_the_formulas(threads: int, dtype: torch.dtype) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for rows, inter in SHAPES:
            gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
            # the formulas on views of gate_up, as the MLP had them (torch's gelu rounds differently on a copy)
            gate, up = gate_up.split(inter, dim=-1)
            silu_ref, gelu_ref = F.silu(gate) * up, F.gelu(gate, approximate="tanh") * up
            work = gate_up.clone()
            out = silu_mul(work, inter)
            assert torch.equal(out, silu_ref)
            assert torch.equal(silu_mul_new(gate_up, inter), silu_ref)
            assert out.data_ptr() == work.data_ptr() and out.stride() == (2 * inter, 1)  # the gate half, in place
            assert torch.equal(work[:, inter:], up)  # the up half as it was
            assert torch.equal(gelu_tanh_mul(gate_up.clone(), inter), gelu_ref)
    finally:
        torch.set_num_threads(before)


def test_the_mlp_gives_the_out_of_place_result() -> None:
    torch.manual_seed(0)
    mlp = SwiGLUMLP(64, 96)
    new = SwiGLUMLP(64, 96, silu_mul_new)
    new.load_state_dict(mlp.state_dict())
    x = torch.randn(40, 64)
    with torch.inference_mode():
        assert torch.equal(mlp(x), new(x))


@pytest.mark.parametrize("activation_dtype", ["int16", "int8"])
def test_a_long_step_runs_the_mlp_on_slices_of_rows_with_the_same_result(activation_dtype: str) -> None:
    from asyncinfer.models import layers
    from asyncinfer.models.quant import Q4_0Linear, Q8_0Linear

    hidden, inter, rows = 256, 4096, 600  # gate_up of 600 rows: 18.75 MiB, past MLP_SLICE_BYTES
    assert rows * 2 * inter * 4 > layers.MLP_SLICE_BYTES
    torch.manual_seed(1)
    mlp = SwiGLUMLP(hidden, inter)
    mlp.gate_up_proj = Q4_0Linear(torch.randn(2 * inter, hidden) / 16, None, activation_dtype=activation_dtype)
    mlp.down_proj = Q8_0Linear(torch.randn(hidden, inter) / 64, None, activation_dtype=activation_dtype)
    x = torch.randn(rows, hidden)
    seen: list[int] = []
    whole = mlp._rows(x)
    mlp.gate_up_proj.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    with torch.inference_mode():
        sliced = mlp(x)
    assert seen == [300, 300]  # two slices, the product of each under MLP_SLICE_BYTES
    assert torch.equal(sliced, whole)
    seen.clear()
    mlp(x[: layers.MLP_SLICE_MIN_ROWS * 2 - 1])  # too few rows to slice: one call
    assert seen == [layers.MLP_SLICE_MIN_ROWS * 2 - 1]
