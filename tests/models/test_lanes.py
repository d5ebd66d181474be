"""Q4_0 and Q4_1 in lanes (kernels.pack_lanes, gemm(lanes=True); csrc/gemm8.c's lanes_gemm): the layout's bytes,
its GEMM against the int8 rows (the same integers, float32 rounding apart), each activation row's result the same
to the last bit whatever the batch, the tile reading the lanes (a prefill's) the same bits as the lanes' GEMM and as
the tile over ggml's blocks, and the refusals."""

from __future__ import annotations

import pytest
import torch

from asyncinfer import kernels

FORMATS = ["q4_0", "q4_1"]  # the formats held in lanes


def q4_0(rows: int, k: int, seed: int, fmt: str = "q4_0") -> torch.Tensor:
    """ggml's blocks of random weights (for Q4_0 also the kernels' layout)."""
    gen = torch.Generator().manual_seed(seed)
    return kernels.quantize(torch.randn(rows, k, generator=gen) * 0.1, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_layout_puts_sixteen_rows_of_a_block_together_and_unpacks_to_the_same_blocks(fmt) -> None:
    blocks = q4_0(48, 96, seed=1, fmt=fmt)  # 3 groups of 16 rows, 3 blocks a row
    size, head = kernels.BLOCK_FORMATS[fmt][1], {"q4_0": 2, "q4_1": 4}[fmt]
    lanes = kernels.pack_lanes(blocks, fmt)
    assert lanes.shape == blocks.shape and lanes.dtype == torch.uint8
    assert torch.equal(kernels.unpack_lanes(lanes, fmt), blocks)
    groups = lanes.reshape(3, 3, 16 * size)  # [group, block, bytes]
    for g, b, r in ((0, 0, 0), (1, 2, 5), (2, 1, 15)):
        blk = blocks[16 * g + r, size * b: size * b + size]
        assert torch.equal(groups[g, b, 2 * r: 2 * r + 2], blk[:2])  # row r's float16 scale
        if fmt == "q4_1":  # then the 16 minimums
            assert torch.equal(groups[g, b, 32 + 2 * r: 34 + 2 * r], blk[2:4])
        for c in range(4):  # run c: bytes 4c to 4c + 3 of each row's nibbles, row r at 4r
            at = 16 * head + 64 * c + 4 * r
            assert torch.equal(groups[g, b, at: at + 4], blk[head + 4 * c: head + 4 + 4 * c])
    wide = torch.cat([blocks, blocks], dim=1)[:, : blocks.shape[1]]  # a view: not contiguous, the same blocks
    assert not wide.is_contiguous() and torch.equal(kernels.pack_lanes(wide, fmt), lanes)
    for empty in (blocks[:0], blocks[:, :0]):  # no rows, no blocks
        packed = kernels.pack_lanes(empty, fmt)
        assert packed.shape == empty.shape and kernels.unpack_lanes(packed, fmt).shape == empty.shape


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.skipif(not kernels.available(), reason="the kernels cannot run here")
def test_the_lanes_gemm_is_the_int8_rows_product_and_each_row_is_the_same_in_any_batch(fmt) -> None:
    n = 48
    for k in (512, 800):  # 800: 25 blocks, no run of 16
        blocks = q4_0(n, k, seed=k, fmt=fmt)
        lanes, plain = kernels.pack_lanes(blocks, fmt), kernels.pack(blocks, fmt)
        dense = kernels.dequantize(blocks, fmt)
        gen = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=gen)
        x = torch.randn(21, k, generator=gen)  # passes of 8 rows and a tail of 5
        x[0, 32:64] *= 1000
        alone = torch.cat([kernels.gemm(x[i:i + 1], lanes, fmt, n, bias, activation_dtype="int8", lanes=True)
                           for i in range(x.shape[0])])
        for rows in (2, 3, 8, 9, 16, 21):
            got = kernels.gemm(x[:rows], lanes, fmt, n, bias, activation_dtype="int8", lanes=True)
            assert torch.equal(got, alone[:rows]), (k, rows)  # the same bits whatever the batch
            want = kernels.gemm(x[:rows], plain, fmt, n, bias, activation_dtype="int8")  # the int8 rows
            bound = 1e-5 * (x[:rows].abs() @ dense.abs().T) + 1e-6
            assert ((got - want).abs() <= bound).all(), (k, rows, (got - want).abs().max().item())
            if rows >= 8:  # the lanes ran: another order of float32 sums than the rows'
                assert not torch.equal(got, want), (k, rows)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.skipif(not kernels.available(), reason="the kernels cannot run here")
def test_the_tile_over_the_lanes_is_the_lanes_gemm_and_the_tile_over_the_blocks_bit_for_bit(fmt) -> None:
    """One float32 operation sequence a row whatever the kernel: the prefill's tile (reading each group of 16 weight
    rows unpacked whole), the decode step's lanes GEMM and the tile over the format's own layout give the same bits, at
    row counts that fill a tile's group, pass it, and stay below it (on the variants without the tile, scalar and
    avx2, the tile flag runs the lanes' GEMM and the blocks' rows: those two differ in their order of sums). The
    lanes' own name asks for the same layout."""
    n, k = 64, 1024
    blocks = q4_0(n, k, seed=9, fmt=fmt)
    lanes, plain = kernels.pack_lanes(blocks, fmt), kernels.pack(blocks, fmt)
    gen = torch.Generator().manual_seed(9)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 7, 16, 33, 70):
        x = torch.randn(rows, k, generator=gen)
        x[0, 64:96] *= 1000
        own = kernels.gemm(x, lanes, fmt, n, bias, activation_dtype="int8", lanes=True)
        tile = kernels.gemm(x, lanes, fmt, n, bias, activation_dtype="int8", int8_kernel="tile", lanes=True)
        named = kernels.gemm(x, lanes, kernels.lanes_name(fmt), n, bias, activation_dtype="int8", int8_kernel="tile")
        plain_tile = kernels.gemm(x, plain, fmt, n, bias, activation_dtype="int8", int8_kernel="tile")
        assert torch.equal(own, tile) and torch.equal(tile, named), rows
        if kernels.isa() in kernels.LANES_ISAS:
            assert torch.equal(tile, plain_tile), rows
    with pytest.raises(ValueError, match="int8 activations only"):
        kernels.gemm(x, lanes, kernels.lanes_name(fmt), n, activation_dtype="int16")


@pytest.mark.skipif(not kernels.available(), reason="the kernels cannot run here")
def test_lanes_are_refused_outside_q4_0_and_q4_1_with_int8_activations_and_sixteen_row_groups() -> None:
    x = torch.randn(2, 64)
    lanes = kernels.pack_lanes(q4_0(16, 64, seed=2))
    with pytest.raises(ValueError, match="int8 activations only"):
        kernels.gemm(x, lanes, "q4_0", 16, activation_dtype="int16", lanes=True)
    q8 = kernels.pack(q4_0(16, 64, seed=2, fmt="q8_0"), "q8_0")
    with pytest.raises(ValueError, match=r"lanes=True: only \['q4_0', 'q4_1'\] are held in lanes, got fmt='q8_0'"):
        kernels.gemm(x, q8, "q8_0", 16, activation_dtype="int8", lanes=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.gemm(x, q4_0(24, 64, seed=3), "q4_0", 24, activation_dtype="int8", lanes=True)
    with pytest.raises(TypeError, match="lanes must be True or False"):
        kernels.gemm(x, lanes, "q4_0", 16, activation_dtype="int8", lanes=1)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        kernels.pack_lanes(q4_0(20, 64, seed=4))
    with pytest.raises(ValueError, match="regroups"):
        kernels.pack_lanes(q4_0(16, 64, seed=4, fmt="q8_0"), "q8_0")
    with pytest.raises(ValueError, match="only"):
        kernels.lanes_name("q8_0")
    with pytest.raises(TypeError, match="fmt must be a block format name"):
        kernels.lanes_name(None)
    with pytest.raises(ValueError, match="takes the blocks' own format \\('q4_0'\\); 'q4_0_lanes' names the layout"):
        kernels.pack_lanes(q4_0(16, 64, seed=4), "q4_0_lanes")
    with pytest.raises(TypeError, match=r"bias must be a 1-D tensor \[out_features\], got shape \(2, 8\)"):
        kernels.gemm(x, lanes, "q4_0", 16, torch.zeros(2, 8), activation_dtype="int8", lanes=True)


# ---- the engine's choice: Q4_0 / Q4_1 projections of a decoder layer with int8 activations --------------------------


@pytest.fixture(params=[True, False], ids=["lanes-native", "lanes-not-native"])
def lanes_here(request, monkeypatch) -> bool:
    """The choice both ways on every machine: where the variant has no vector lanes (scalar, avx2) the layers are made
    to take them anyway (their plain C loop), and where it has, made to keep ggml's layout."""
    monkeypatch.setattr(kernels, "lanes_native", lambda: request.param)
    return request.param


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.skipif(not kernels.available(), reason="the kernels cannot run here")
def test_a_layer_takes_the_lanes_only_for_int8_tile_projections_of_sixteen_row_groups(monkeypatch, fmt) -> None:
    from asyncinfer.models.quant import Q8_0Linear, block_layer_class

    monkeypatch.setattr(kernels, "lanes_native", lambda: True)
    cls = block_layer_class(fmt)
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(32, 96, generator=gen), torch.randn(32, generator=gen)
    blocks = kernels.quantize(w, fmt)
    layer = cls(w, bias, activation_dtype="int8")
    from_file = cls.from_blocks(blocks, bias, activation_dtype="int8")
    for held in (layer, from_file):
        name, packed, _ = held.kernel_weights()
        assert held.lanes and name == kernels.lanes_name(fmt) and "in lanes" in held.kind
        assert torch.equal(kernels.unpack_lanes(packed, fmt), blocks)  # the same bytes, in lanes
        for rows in (1, 40):  # the lanes' GEMM, the tile over the lanes: the same bits as over the plain layout
            x = torch.randn(rows, 96, generator=gen)
            want = kernels.gemm(x, packed, fmt, 32, bias, activation_dtype="int8", int8_kernel="tile", lanes=True)
            assert torch.equal(held(x), want)
            if rows == 40 and kernels.isa() in kernels.LANES_ISAS:  # the tile's sums over the plain layout
                plain = kernels.gemm(x, kernels.pack(blocks, fmt), fmt, 32, bias, activation_dtype="int8",
                                     int8_kernel="tile")
                assert torch.equal(held(x), plain)
    monkeypatch.setattr(cls, "_CHUNK_ROWS", 16)  # built from floats 16 rows at a time: the same lanes, joined
    chunked = cls(w, bias, activation_dtype="int8")
    assert chunked.lanes and torch.equal(chunked.kernel_weights()[1], layer.kernel_weights()[1])
    assert not cls(w, bias).lanes  # int16 activations
    assert not cls(w, bias, activation_dtype="int8", int8_kernel="rows").lanes  # the output projection's
    assert not cls(w[:24], bias[:24], activation_dtype="int8").lanes  # 24 rows: not groups of 16
    assert not Q8_0Linear(w, bias, activation_dtype="int8").lanes
    assert cls(w, bias).kernel_weights()[0] == fmt
    monkeypatch.setattr(kernels, "lanes_native", lambda: False)
    assert not cls(w, bias, activation_dtype="int8").lanes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.skipif(not kernels.available(), reason="the kernels cannot run here")
def test_the_kernels_decode_step_multiplies_the_lanes_and_a_row_is_the_same_beside_forty_others(
        tmp_path, lanes_here, fmt) -> None:
    """A Q4_0 (Q4_1) model with int8 activations: its decoder projections in lanes where the choice says so (never its
    output projection, which then keeps the rows at every count), the kernels' one-call step taking them (the format's
    lanes name); its logits are the op-by-op
    reference's within what a last bit's rounding flip moves, and one request's logits are the same bits decoded
    alone (the lanes' GEMM) as beside 40 others (the tile over the lanes, where the build has it). Kept out of the
    lanes on a build with the int8 tile, the step's 41 rows take the tile over ggml's blocks and its one row the
    rows: the two differ in their last bits (tests/models/test_int8_activations.py)."""
    same = lanes_here or kernels.isa() not in kernels.INT16_TILE_ISAS  # the AVX-512 builds: the int8 tile too
    from asyncinfer.models import load_model
    from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend, SdpaBackend
    from asyncinfer.models.decode_backends import KernelDecode, TorchDecode
    from asyncinfer.models.quant import BlockLinear, apply_weight_format
    from tests.helpers import PagedRunner
    from tests.models.test_kernels import lossless_tiny

    lossless_tiny("qwen2", tmp_path)  # q/k/v with a bias, a tied head
    model = load_model(tmp_path, torch.float32, "cpu").model
    apply_weight_format(model, fmt, activation_dtype="int8")
    head = model.output_proj
    layers = [m for m in model.modules() if isinstance(m, BlockLinear) and m is not head]
    assert len(layers) == 4 * model.config.num_layers
    assert all(m.lanes == lanes_here for m in layers) and not head.lanes
    cpu = torch.device("cpu")
    kernel, reference = KernelDecode(model, KernelDecodeSdpaBackend(), cpu), TorchDecode(model, SdpaBackend(), cpu)
    held = kernels.lanes_name(fmt) if lanes_here else fmt
    assert all(layer._args[name][0] == held for layer in kernel.stack.layers
               for name in ("qkv", "o", "gate_up", "down"))
    # over layers in lanes the head keeps the rows at every count (so a request's logits keep their bits in any
    # step); over layers in ggml's blocks it takes the tile from STEP_TILE_MIN_ROWS rows, as they do
    assert all(layer.in_lanes == lanes_here for layer in kernel.stack.layers)
    assert bool(kernel.stack._head_code & kernels.int8_kernel_flag("tile")) != lanes_here
    alone, crowd, plain = PagedRunner(model, seed=1), PagedRunner(model, num_blocks=640, seed=2), PagedRunner(model, seed=1)
    prompt = list(range(3, 14))
    # 40 others: the step's 41 rows pass the 32 from which the decode step multiplies by the tile over the lanes
    others = [(s, [(7 * s + j) % 250 + 3 for j in range(5 + s % 17)]) for s in range(2, 42)]
    first = kernel.forward(alone.step_batch([(1, prompt)], last_only=True), alone.kv_caches)
    kernel.forward(crowd.step_batch([(1, prompt), *others], last_only=True), crowd.kv_caches)
    reference.forward(plain.step_batch([(1, prompt)], last_only=True), plain.kv_caches)
    last, crowd_last = int(first.logits[0].argmax()), [t[-1] for _, t in others]
    for _ in range(4):
        a = kernel.forward(alone.step_batch([(1, [last])]), alone.kv_caches)
        b = kernel.forward(crowd.step_batch([(1, [last]), *((s, [t]) for (s, _), t in zip(others, crowd_last))]),
                           crowd.kv_caches)
        r = reference.forward(plain.step_batch([(1, [last])]), plain.kv_caches)
        assert b.logits.shape[0] == 41 and torch.equal(a.logits[0], b.logits[0]) == same  # the bits beside 40 others
        assert ((b.logits[0] - r.logits[0]).norm() / r.logits[0].norm()).item() < 3e-2
        assert ((a.logits - r.logits).norm() / r.logits.norm()).item() < 3e-2
        last, crowd_last = a.greedy_ids[0], b.greedy_ids[1:]
    if lanes_here:  # the kernels' layer takes the lanes with int8 activations only, in groups of 16 rows
        args = kernel.stack.layers[0]._args
        with pytest.raises(ValueError, match="int8 activations only"):
            kernels.DecodeLayer(**{**args, "activation_dtype": "int16"})
        o = args["o"]
        with pytest.raises(ValueError, match="multiple of 16 rows"):
            kernels.DecodeLayer(**{**args, "o": ((held, fmt), (o[1][:40], o[1][40:]), None)})


@pytest.mark.skipif(not kernels.available(), reason="the kernels cannot run here")
@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_engine_serves_a_model_in_lanes_with_the_references_greedy_tokens(tmp_path, lanes_here, fmt) -> None:
    """``AsyncEngine`` with ``quantization="q4_0"`` (``"q4_1"``) and int8 activations: the layers hold the lanes where the choice
    says so, decode steps are one kernel call, and two concurrent requests get the greedy tokens the same model
    gives one request at a time op by op (its prefills' tile and its decodes' lanes: the same GEMM results)."""
    from asyncinfer import AsyncEngine
    from asyncinfer.models.decode_backends import KernelDecode
    from asyncinfer.models.quant import BlockLinear
    from tests.helpers import PagedRunner, greedy
    from tests.models.test_kernels import lossless_tiny

    lossless_tiny("llama", tmp_path)
    engine = AsyncEngine.from_pretrained(tmp_path, kv_cache_memory=2**22, max_model_len=128, device="cpu",
                                         block_size=16, quantization=fmt, activation_dtype="int8", num_threads=1)
    async with engine:
        model = engine.core.runner.model
        assert type(engine.core.runner.decode) is KernelDecode
        assert [m.lanes for m in model.modules() if isinstance(m, BlockLinear)] == [lanes_here] * 8 + [False]
        prompts = [[5, 6, 7, 8], list(range(3, 40))]
        import asyncio

        outs = await asyncio.gather(*(engine.generate(p, greedy(12)) for p in prompts))
    expected = [PagedRunner(model, block_size=16).greedy(0, p, 12) for p in prompts]
    assert [o.token_ids for o in outs] == expected
