"""Q4_0 in lanes (kernels.pack_lanes, gemm(lanes=True); csrc/gemm8.c's ai_gemm8_q4_0_lanes): the layout's bytes,
its GEMM against the int8 rows (the same integers, float32 rounding apart), each activation row's result the same
to the last bit whatever the batch, and the refusals."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import kernels


def q4_0(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return kernels.pack(kernels.quantize(torch.randn(rows, k, generator=gen) * 0.1, "q4_0"), "q4_0")


def test_the_layout_puts_sixteen_rows_of_a_block_together_and_unpacks_to_the_same_blocks() -> None:
    blocks = q4_0(48, 96, seed=1)  # 3 groups of 16 rows, 3 blocks a row
    lanes = kernels.pack_lanes(blocks)
    assert lanes.shape == blocks.shape and lanes.dtype == torch.uint8
    assert torch.equal(kernels.unpack_lanes(lanes), blocks)
    groups = lanes.reshape(3, 3, 288)  # [group, block, bytes]
    for g, b, r in ((0, 0, 0), (1, 2, 5), (2, 1, 15)):
        blk = blocks[16 * g + r, 18 * b: 18 * b + 18]
        assert torch.equal(groups[g, b, 2 * r: 2 * r + 2], blk[:2])  # row r's float16 scale
        for c in range(4):  # run c: bytes 4c to 4c + 3 of each row's nibbles, row r at 4r
            assert torch.equal(groups[g, b, 32 + 64 * c + 4 * r: 32 + 64 * c + 4 * r + 4], blk[2 + 4 * c: 6 + 4 * c])


@pytest.mark.skipif(not kernels.available(), reason="the kernels cannot run here")
def test_the_lanes_gemm_is_the_int8_rows_product_and_each_row_is_the_same_in_any_batch() -> None:
    n = 48
    for k in (512, 800):  # 800: 25 blocks, no run of 16
        blocks = q4_0(n, k, seed=k)
        lanes = kernels.pack_lanes(blocks)
        dense = kernels.dequantize(blocks, "q4_0")
        gen = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=gen)
        x = torch.randn(21, k, generator=gen)  # passes of 8 rows and a tail of 5
        x[0, 32:64] *= 1000
        alone = torch.cat([kernels.gemm(x[i:i + 1], lanes, "q4_0", n, bias, activation_dtype="int8", lanes=True)
                           for i in range(x.shape[0])])
        for rows in (2, 3, 8, 9, 16, 21):
            got = kernels.gemm(x[:rows], lanes, "q4_0", n, bias, activation_dtype="int8", lanes=True)
            assert torch.equal(got, alone[:rows]), (k, rows)  # the same bits whatever the batch
            want = kernels.gemm(x[:rows], blocks, "q4_0", n, bias, activation_dtype="int8")  # the int8 rows
            bound = 1e-5 * (x[:rows].abs() @ dense.abs().T) + 1e-6
            assert ((got - want).abs() <= bound).all(), (k, rows, (got - want).abs().max().item())
            if rows >= 8:  # the lanes ran: another order of float32 sums than the rows'
                assert not torch.equal(got, want), (k, rows)


@pytest.mark.skipif(not kernels.available(), reason="the kernels cannot run here")
def test_lanes_are_refused_outside_q4_0_with_int8_activations_and_sixteen_row_groups() -> None:
    x = torch.randn(2, 64)
    lanes = kernels.pack_lanes(q4_0(16, 64, seed=2))
    with pytest.raises(ValueError, match="int8 activations only"):
        kernels.gemm(x, lanes, "q4_0", 16, activation_dtype="int16", lanes=True)
    with pytest.raises(ValueError, match="int8 activations only"):
        kernels.gemm(x, q4_0(16, 64, seed=2), "q4_1", 16, activation_dtype="int8", lanes=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.gemm(x, q4_0(24, 64, seed=3), "q4_0", 24, activation_dtype="int8", lanes=True)
    with pytest.raises(TypeError, match="lanes must be True or False"):
        kernels.gemm(x, lanes, "q4_0", 16, activation_dtype="int8", lanes=1)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        kernels.pack_lanes(q4_0(20, 64, seed=4))
