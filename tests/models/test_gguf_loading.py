"""A GGUF file's projections are built in their weight format as they are read (its own blocks where it keeps
them, never through a float32 model), and bad files are refused from the header alone.

The files are random-weight GGUFs written by ``benchmarks/make_gguf.py``, the benchmarks' own generator.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncinfer import kernels
from asyncinfer.errors import ModelLoadError
from asyncinfer.memory import plan_memory
from asyncinfer.models.gguf_file import GGUFFile
from asyncinfer.models.loader import open_checkpoint
from asyncinfer.models.quant import (
    BlockEmbedding,
    BlockLinear,
    FormatLinear,
    MixedBlockLinear,
    WeightFormat,
    apply_weight_format,
    embedding_formats,
    layer_formats,
    linear_bytes,
    mixed_parts,
    native_fallback,
    weight_bytes,
)
from benchmarks.make_gguf import SHAPES, tensors, write
from tests.helpers import float_bits, loaded_bytes

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(SHAPES["tiny"], hidden=128, intermediate=256, heads=4, kv_heads=2, vocab_size=320)


def tiny_gguf(path: Path, kind: str = "q8_0", head: str = "q8_0", arch: str = "llama", **options) -> Path:
    write(path, TINY, arch, kind, head, "none", 0, **options)
    return path


def quiet(done: int, total: int) -> None:
    """A progress callback that shows nothing."""


def _expected_block(stored: str) -> type[FormatLinear] | str:
    """What "native" makes of a layer stored in ``stored``: its blocks where a kernel takes them, else the fallback."""
    return stored if stored in kernels.BLOCK_FORMATS else native_fallback()


CASES = [  # (projections, embedding and head, arch, method, tied)
    ("q4_1", "q8_0", "llama", "native", False),
    ("q4_1", "q8_0", "llama", "q4_1", True),
    ("q8_0", "q8_0", "qwen2", "native", False),
    ("q4_0", "q8_0", "llama", "native", True),
    ("f16", "f16", "llama", "native", False),
    ("q8_0", "q8_0", "llama", "float16", False),
    ("q4_1", "q8_0", "qwen2", "q8_0", True),
    ("q8_0", "f16", "llama", None, False),
    ("bf16", "bf16", "llama", "native", False),
    ("bf16", "q8_0", "qwen2", None, True),
]


@pytest.mark.parametrize("kind, head, arch, method, tied", CASES)
def test_layers_built_from_the_file_equal_those_converted_from_the_float_model(tmp_path, kind, head, arch, method,
                                                                              tied) -> None:
    layout = [t for t in tensors(TINY, arch) if not (tied and t[0] == "output.weight")]
    checkpoint = open_checkpoint(tiny_gguf(tmp_path / "m.gguf", kind, head, arch, layout=layout))
    assert checkpoint.config.tie_word_embeddings == tied
    fmt = WeightFormat(method)
    direct = checkpoint.load(torch.float32, "cpu", quiet, weight_format=fmt)
    assert direct.weight_format == fmt
    converted = checkpoint.load(torch.float32, "cpu", quiet).model  # the float32 model, then the format
    assert apply_weight_format(converted, method) == sum(
        m.nbytes for m in direct.model.modules() if isinstance(m, FormatLinear))
    modules, reference = dict(direct.model.named_modules()), dict(converted.named_modules())
    # The embedding stays in the file's blocks under a block format (never a float table), the float model's is a
    # float table: the same rows, bit for bit, for every id.
    in_blocks = embedding_formats(checkpoint.config, method)["embed_tokens"] != "float32"
    assert in_blocks == (method in ("native", "q4_1", "q8_0") and head == "q8_0")
    embedding = modules.pop("embed_tokens")
    assert type(embedding) is (BlockEmbedding if in_blocks else torch.nn.Embedding)
    every_id = torch.arange(TINY["vocab_size"])
    assert torch.equal(embedding(every_id), reference.pop("embed_tokens")(every_id))
    if in_blocks:  # a tied head in the same blocks is read, not copied
        assert embedding.shared == (tied and direct.model.output_proj.fmt == "q8_0")
        assert embedding.nbytes == (0 if embedding.shared else linear_bytes("q8_0", TINY["vocab_size"],
                                                                            TINY["hidden"], bias=False))
    assert {n: type(m) for n, m in modules.items()} == {n: type(m) for n, m in reference.items()}
    generator = torch.Generator().manual_seed(0)
    for name, module in modules.items():
        if isinstance(module, FormatLinear):
            x = torch.randn(3, module.in_features, generator=generator)
            assert torch.equal(module(x), reference[name](x)), name
            if isinstance(module, BlockLinear):
                assert module.lossless == reference[name].lossless, name
    params, reference_params = dict(direct.model.named_parameters()), dict(converted.named_parameters())
    if in_blocks:
        del reference_params["embed_tokens.weight"]
    assert params.keys() == reference_params.keys()
    assert all(torch.equal(params[n], reference_params[n]) for n in params)
    # the planner counted these bytes from the header alone
    assert weight_bytes(checkpoint.config, 4, method) == loaded_bytes(direct.model)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_0", "f16", "bf16"])
def test_native_keeps_each_layer_in_its_files_format_where_a_kernel_takes_it(tmp_path, kind) -> None:
    checkpoint = open_checkpoint(tiny_gguf(tmp_path / "m.gguf", kind, "q8_0"))
    model = checkpoint.load(torch.float32, "cpu", quiet, weight_format=WeightFormat("native")).model
    stored = dict(checkpoint.config.stored_formats)
    assert set(stored.values()) == {{"f16": "float16", "bf16": "bfloat16"}.get(kind, kind), "q8_0"}
    formats = layer_formats(checkpoint.config, "native")
    assert formats == {name: _expected_block(stored[name]) for name in formats}
    assert len(formats) == 4 * TINY["layers"] + 1  # qkv, o, gate_up, down per layer, and the head
    blocks = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert all(m.lossless for m in blocks)  # straight from the file's blocks: exactly its weights
    assert sum(fmt in kernels.BLOCK_FORMATS for fmt in formats.values()) == len(blocks)


def test_a_file_of_mixed_formats_takes_each_tensors_own(tmp_path, caplog) -> None:
    """Q4_K_M-style: most layers in one format, some in others; a fused layer whose parts differ mixes them part
    by part where a kernel takes every part, and falls back where one is a float tensor."""
    types = {"blk.0.attn_v.weight": "q8_0", "blk.1.ffn_down.weight": "q8_0", "blk.1.attn_output.weight": "f16",
             "blk.1.ffn_up.weight": "f16"}
    path = tiny_gguf(tmp_path / "mixed.gguf", "q4_1", "q8_0", types=types)
    checkpoint = open_checkpoint(path)
    stored = dict(checkpoint.config.stored_formats)
    assert checkpoint.config.native_format == "native"
    assert stored["layers.0.attn.qkv_proj"] == "q4_1:128+q4_1:64+q8_0:64"  # q, k, v: each part's format and rows
    assert mixed_parts(stored["layers.0.attn.qkv_proj"]) == (("q4_1", 128), ("q4_1", 64), ("q8_0", 64))
    assert stored["layers.1.attn.qkv_proj"] == "q4_1" and stored["layers.1.mlp.gate_up_proj"] == "q4_1:256+float16:256"
    assert (stored["layers.1.mlp.down_proj"], stored["layers.1.attn.o_proj"]) == ("q8_0", "float16")
    model = checkpoint.load(torch.float32, "cpu", quiet, weight_format=WeightFormat("native")).model
    formats = layer_formats(checkpoint.config, "native")
    assert formats["layers.0.attn.qkv_proj"] == "q4_1:128+q4_1:64+q8_0:64"
    assert formats["layers.1.mlp.gate_up_proj"] == formats["layers.1.attn.o_proj"] == native_fallback()
    assert formats["layers.1.mlp.down_proj"] == "q8_0" and formats["layers.1.attn.qkv_proj"] == "q4_1"
    qkv = model.layers[0].attn.qkv_proj
    assert isinstance(qkv, MixedBlockLinear) and [p.fmt for p in qkv.parts] == ["q4_1", "q4_1", "q8_0"]
    assert qkv.lossless and [p.out_features for p in qkv.parts] == [128, 64, 64]
    assert weight_bytes(checkpoint.config, 4, "native") == loaded_bytes(model)


def test_the_engine_loads_a_mixed_file_in_its_own_formats_and_says_which(tmp_path, caplog) -> None:
    import logging

    from asyncinfer import AsyncEngine

    types = {"blk.0.attn_v.weight": "q8_0"}
    path = tiny_gguf(tmp_path / "mixed.gguf", "q4_1", "q8_0", types=types)
    with caplog.at_level(logging.INFO, logger="asyncinfer"):
        engine = AsyncEngine.from_pretrained(path, kv_cache_memory=1 << 20, max_model_len=64)
    assert engine.config.quantization == "native"
    assert f"0 in {native_fallback()} (none)" in caplog.text
    assert "1 projection(s) mix formats part by part (q4_1+q4_1+q8_0): layers.0.attn.qkv_proj" in caplog.text


Q4_K_M = dict(TINY, hidden=256, intermediate=512, heads=4, kv_heads=2)  # whole 256-weight super-blocks everywhere
Q4_K_M_TYPES = {f"blk.{i}.{name}.weight": "q6_k" for i in range(Q4_K_M["layers"])
                for name in ("attn_v", "ffn_up", "ffn_down")}  # the rest in Q4_K: q/k, o, gate


def test_a_q4_k_m_mix_built_from_the_file_equals_the_float_model_converted(tmp_path) -> None:
    """"native" on the float32 model of the same file (apply_weight_format without a source) quantises each part
    of a mixed layer in its own format: the same layers and bytes as those built from the file's blocks, outputs
    within the k-quants' rounding (asyncinfer's plain quantiser does not choose llama.cpp's scales, so the
    re-quantised blocks are not the file's: docs/formats.md)."""
    path = tmp_path / "q4_k_m.gguf"
    write(path, Q4_K_M, "llama", "q4_k", "q8_0", "none", 0, types=Q4_K_M_TYPES)
    checkpoint = open_checkpoint(path)
    direct = checkpoint.load(torch.float32, "cpu", quiet, weight_format=WeightFormat("native")).model
    converted = checkpoint.load(torch.float32, "cpu", quiet).model
    assert apply_weight_format(converted, "native") == sum(
        m.nbytes for n, m in direct.named_modules() if isinstance(m, FormatLinear) and ".parts." not in n)
    modules, reference = dict(direct.named_modules()), dict(converted.named_modules())
    every_id = torch.arange(Q4_K_M["vocab_size"])  # the embedding: the file's Q8_0 blocks, the float table's rows
    assert type(modules["embed_tokens"]) is BlockEmbedding and modules["embed_tokens"].fmt == "q8_0"
    assert torch.equal(modules.pop("embed_tokens")(every_id), reference.pop("embed_tokens")(every_id))
    assert {n: type(m) for n, m in modules.items()} == {n: type(m) for n, m in reference.items()}
    generator = torch.Generator().manual_seed(0)
    for name, module in modules.items():
        if isinstance(module, MixedBlockLinear):
            x = torch.randn(3, module.in_features, generator=generator)
            assert [p.fmt for p in module.parts] == [p.fmt for p in reference[name].parts], name
            got, want = reference[name](x), module(x)
            assert ((got - want).norm() / want.norm()).item() < 0.05, name
            assert module.lossless, name  # the file's own blocks


async def test_auto_loads_a_q4_k_m_mix_part_by_part_in_its_files_own_blocks(tmp_path, caplog) -> None:
    """llama.cpp's Q4_K_M layout (q/k Q4_K, v Q6_K; gate Q4_K, up Q6_K): "auto" is "native", each fused projection
    a MixedBlockLinear of the file's own blocks (lossless), the fused kernel decodes, and its greedy tokens are the
    float32 model's (the same file, dequantised); the planner counted exactly the bytes built."""
    import logging

    from asyncinfer import AsyncEngine
    from asyncinfer.models.decode_backends import KernelDecode, kernel_decode_blocker
    from tests.helpers import greedy

    assert kernels.available(), kernels.unavailable_reason()
    path = tmp_path / "q4_k_m.gguf"
    write(path, Q4_K_M, "llama", "q4_k", "q8_0", "none", 0, types=Q4_K_M_TYPES)
    checkpoint = open_checkpoint(path)
    q, kv, inter = 256, 128, 512
    stored = dict(checkpoint.config.stored_formats)
    assert checkpoint.config.native_format == "native"
    assert stored["layers.0.attn.qkv_proj"] == f"q4_k:{q}+q4_k:{kv}+q6_k:{kv}"
    assert stored["layers.1.mlp.gate_up_proj"] == f"q4_k:{inter}+q6_k:{inter}"
    options = {"kv_cache_memory": 1 << 20, "max_model_len": 64}
    with caplog.at_level(logging.INFO, logger="asyncinfer"):
        engine = AsyncEngine.from_pretrained(path, **options)
    reference = AsyncEngine.from_pretrained(path, quantization=None, **options)
    assert engine.config.quantization == "native" and reference.config.quantization is None
    decode = engine.core.runner.decode
    assert isinstance(decode, KernelDecode) and kernel_decode_blocker(decode.model) is None
    model = decode.model
    for layer in model.layers:
        qkv, gate_up = layer.attn.qkv_proj, layer.mlp.gate_up_proj
        assert isinstance(qkv, MixedBlockLinear) and isinstance(gate_up, MixedBlockLinear)
        assert qkv.kernel_weights()[0] == ("q4_k", "q4_k", "q6_k") and gate_up.kernel_weights()[0] == ("q4_k", "q6_k")
        assert [p.out_features for p in qkv.parts] == [q, kv, kv] and qkv.lossless and gate_up.lossless
        assert (layer.attn.o_proj.fmt, layer.mlp.down_proj.fmt) == ("q4_k", "q6_k")
    assert ("2 projection(s) mix formats part by part (q4_k+q4_k+q6_k): layers.0.attn.qkv_proj, "
            "layers.1.attn.qkv_proj") in caplog.text
    assert f"0 in {native_fallback()} (none)" in caplog.text
    # the planner's bytes, from the header alone, are the layers built
    assert weight_bytes(checkpoint.config, 4, "native") == loaded_bytes(model)
    mixed = [m for m in model.modules() if isinstance(m, MixedBlockLinear)]
    assert sum(m.nbytes for m in mixed) == sum(
        linear_bytes(layer_formats(checkpoint.config, "native")[name], m.out_features, m.in_features, bias=False)
        for name, m in model.named_modules() if isinstance(m, MixedBlockLinear))
    prompts = [[5, 9, 14, 3], [7, 100, 250, 31, 64, 2]]
    async with engine, reference:
        got = await asyncio.gather(*(engine.generate(p, greedy(12)) for p in prompts))
        want = await asyncio.gather(*(reference.generate(p, greedy(12)) for p in prompts))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]



@pytest.mark.parametrize("fmt", list(kernels.formats.LAYOUTS))
@pytest.mark.parametrize("tied", [True, False])
def test_the_embedding_stays_in_its_files_blocks_and_gathers_exactly_the_float_rows(tmp_path, fmt, tied) -> None:
    """An embedding (and head) stored in any block format of LAYOUTS stays in those blocks under "native": no float
    table, each lookup bit for bit the rows of the file's float32 dequantization, in the torch forward and in the
    kernels (kernels.embed_rows, and the one-call step, which dequantizes its rows straight into the residual
    stream: a tied Q4_1 / Q8_0 head's blocks in the kernels' layout, an untied table in ggml's order); a tied
    head's blocks are read, not copied; the weights held are the planner's bytes, the embedding counted from its
    blocks."""
    from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend
    from asyncinfer.models.decode_backends import KernelDecode
    from tests.helpers import PagedRunner

    layout = [t for t in tensors(Q4_K_M, "llama") if not (tied and t[0] == "output.weight")]
    path = tmp_path / f"{fmt}.gguf"
    write(path, Q4_K_M, "llama", "q8_0", fmt, "none", 0, layout=layout)
    checkpoint = open_checkpoint(path)
    assert dict(checkpoint.config.stored_formats)["embed_tokens"] == fmt
    assert embedding_formats(checkpoint.config, "native") == {"embed_tokens": fmt}
    model = checkpoint.load(torch.float32, "cpu", quiet, weight_format=WeightFormat("native")).model
    embedding = model.embed_tokens
    assert isinstance(embedding, BlockEmbedding) and embedding.fmt == fmt
    assert "embed_tokens.weight" not in dict(model.named_parameters())  # no float table at all
    vocab, hidden = Q4_K_M["vocab_size"], Q4_K_M["hidden"]
    reader = GGUFFile(path)
    table = reader.dequantize(next(t for t in reader.tensors if t.name == "token_embd.weight"))  # today's float32
    every_id = torch.arange(vocab)
    assert torch.equal(float_bits(embedding(every_id)), float_bits(table))  # the torch reference's rows
    assert torch.equal(float_bits(kernels.embed_rows(embedding.table, every_id)), float_bits(table))  # the C rows
    assert embedding.table.regrouped == (tied and fmt in ("q4_1", "q8_0"))  # the head's own layout, read in place
    ids = torch.tensor([[7, 0, vocab - 1], [7, 7, 300]])  # any shape, repeats, out of order
    assert torch.equal(embedding(ids), table[ids])
    for bad in (vocab, -1):
        with pytest.raises(IndexError, match=rf"input_ids: a token id is outside the embedding table \[0, {vocab}\)"):
            embedding(torch.tensor([3, bad]))
    # one copy: a tied head in the same blocks is what the embedding reads; else the file's blocks as they lie
    own = linear_bytes(fmt, vocab, hidden, bias=False)
    assert embedding.shared == tied and embedding.nbytes == (0 if tied else own) == (0 if tied else vocab * (
        hidden // kernels.BLOCK_FORMATS[fmt][0]) * kernels.BLOCK_FORMATS[fmt][1])
    if tied:
        assert embedding.table.blocks is model.output_proj.kernel_weights()[1]
    # the planner's bytes are those held: the float table's 4 bytes a weight gone, the blocks (if not the head's) in
    assert weight_bytes(checkpoint.config, 4, "native") == loaded_bytes(model)
    float_table = weight_bytes(checkpoint.config, 4, "native", ("embed_tokens",))  # skipped: the float table
    assert float_table - weight_bytes(checkpoint.config, 4, "native") == vocab * hidden * 4 - (0 if tied else own)
    skipped = checkpoint.load(torch.float32, "cpu", quiet, weight_format=WeightFormat("native", ("embed_tokens",)))
    assert type(skipped.model.embed_tokens) is torch.nn.Embedding and loaded_bytes(skipped.model) == float_table
    # the one-call decode step: the block table's rows give exactly the float table's result
    stack = KernelDecode(model, KernelDecodeSdpaBackend(), torch.device("cpu")).stack
    runner = PagedRunner(model, seed=1, backend=KernelDecodeSdpaBackend())
    runner.step([(1, [3, 4, 5])])
    step = (torch.tensor([vocab - 1, 9]), torch.tensor([1, 2]), model.rotary.cos_cache, model.rotary.sin_cache,
            runner.kv_caches, torch.tensor([1, 2]), torch.zeros(2, 1, dtype=torch.long), torch.tensor([2, 3]))
    from_blocks = stack(step[0], embedding.table, *step[1:], logits=True)
    assert torch.equal(float_bits(from_blocks), float_bits(stack(step[0], table, *step[1:], logits=True)))
    for bad in (vocab, -1):
        with pytest.raises(IndexError, match=rf"input_ids: a token id is outside the embedding table \[0, {vocab}\)"):
            stack(torch.tensor([bad, 9]), embedding.table, *step[1:], logits=True)


@pytest.mark.parametrize("fmt", list(kernels.formats.LAYOUTS))
@pytest.mark.parametrize("tied", [True, False])
async def test_the_engine_decodes_from_the_block_embedding_the_float_tables_greedy_tokens(tmp_path, fmt, tied) -> None:
    """Through the engine ("auto": the file's own formats), the one-call decode step reads the embedding from its
    file's blocks (KernelDecode holds the BlockTable: no torch op gathers the rows), and its greedy tokens are
    those of the same file with a float32 embedding table (``quantization_skip=("embed_tokens",)``); a prompt
    with a token id outside the vocabulary is refused by name before it is queued."""
    from asyncinfer import AsyncEngine, InvalidParameterError
    from asyncinfer.models.decode_backends import KernelDecode
    from tests.helpers import greedy

    assert kernels.available(), kernels.unavailable_reason()
    layout = [t for t in tensors(Q4_K_M, "llama") if not (tied and t[0] == "output.weight")]
    path = tmp_path / f"{fmt}.gguf"
    write(path, Q4_K_M, "llama", "q8_0", fmt, "none", 0, layout=layout)
    options = {"kv_cache_memory": 1 << 20, "max_model_len": 64, "quantization": "auto"}
    engine = AsyncEngine.from_pretrained(path, **options)
    reference = AsyncEngine.from_pretrained(path, quantization_skip=("embed_tokens",), **options)
    for e, kind in ((engine, BlockEmbedding), (reference, torch.nn.Embedding)):
        decode = e.core.runner.decode
        assert isinstance(decode, KernelDecode) and type(decode.model.embed_tokens) is kind
    assert isinstance(engine.core.runner.decode.embed, kernels.BlockTable)
    vocab = Q4_K_M["vocab_size"]
    prompts = [[5, 9, 14, 3], [vocab - 1, 100, 250, 31, 64, 2], [0]]
    async with engine, reference:
        got = await asyncio.gather(*(engine.generate(p, greedy(12)) for p in prompts))
        want = await asyncio.gather(*(reference.generate(p, greedy(12)) for p in prompts))
        with pytest.raises(InvalidParameterError, match="token"):
            await engine.generate([3, vocab], greedy(4))
        assert (await engine.generate(prompts[0], greedy(12))).token_ids == got[0].token_ids  # still serving
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(engine.step_stats().batch_sizes) > 1  # the prompts shared decode steps


# ---- bad files: refused from the header, fast -------------------------------


def test_a_block_count_far_beyond_the_tensors_is_refused_from_the_header_in_well_under_a_second(tmp_path) -> None:
    """The old loader built the model for the metadata's count first: ~50 s and 2.7 GB for 300 000 layers."""
    path = tiny_gguf(tmp_path / "deep.gguf", block_count=300_000)
    start = time.perf_counter()
    for read in (open_checkpoint, plan_memory):
        with pytest.raises(ModelLoadError, match=r"llama.block_count = 300000, but its tensors hold 2 layer\(s\)"):
            read(path)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("edit, message", [
    (lambda t: [(n, (d[0], 2 * d[1]) if n == "blk.1.ffn_up.weight" else d) for n, d in t],
     r"GGUF tensor 'blk.1.ffn_up.weight' \(q8_0\) has shape \(256, 256\), but the file's metadata makes it \(256, 128\)"),
    (lambda t: [(n, d) for n, d in t if n != "blk.0.attn_k.weight"], r"missing 1 tensor\(s\): blk.0.attn_k.weight"),
    (lambda t: [*t, ("blk.0.extra.weight", (4,))], r"1 unexpected tensor\(s\): blk.0.extra.weight"),
    (lambda t: [(n, (64, d[1]) if n == "token_embd.weight" else d) for n, d in t], r"'token_embd.weight'.*\(64, 128\)"),
])
def test_tensors_that_disagree_with_the_metadata_are_refused_naming_the_tensor(tmp_path, edit, message) -> None:
    path = tiny_gguf(tmp_path / "bad.gguf", layout=edit(tensors(TINY, "llama")))
    with pytest.raises(ModelLoadError, match=message):
        open_checkpoint(path)


def _header(fields: bytes = b"", infos: bytes = b"", n_fields: int = 0, n_tensors: int = 0, tail: int = 64) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_fields) + fields + infos + b"\0" * tail


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def _info(name: str, dims: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    return _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack(
        "<IQ", ggml_type, offset)


@pytest.mark.parametrize("data, message", [
    (_header(n_tensors=2**60), "tensor count 1152921504606846976 needs at least"),
    (_header(n_fields=2**40), "metadata count 1099511627776 needs at least"),
    (_header(_string("a") + struct.pack("<IIQ", 9, 4, 2**61), n_fields=1), "metadata 'a'.*array of 2305843009213693952"),
    (_header(_string("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 10 + struct.pack("<IQ", 4, 0),
             n_fields=1),
     "metadata 'a'.*nested more than"),
    (_header(_string("a") + struct.pack("<I", 77), n_fields=1), "metadata 'a'.*unknown metadata value type 77"),
    (_header(_string("general.alignment") + struct.pack("<II", 4, 0), n_fields=1), "alignment' = 0 is not a positive"),
    (_header(_string("general.alignment") + struct.pack("<II", 4, 24), n_fields=1), "24 is not a positive power"),
    (_header(infos=_info("w", (4,) * 5), n_tensors=1), "tensor 'w' has 5 dimensions"),
    (_header(infos=_info("w", (2**40, 2**40)), n_tensors=1), "tensor 'w' runs past the end of the file"),
    (_header(infos=_info("w", (4,), offset=2**63), n_tensors=1), "tensor 'w' runs past the end of the file"),
    (_header(infos=_info("w", (4,), offset=4), n_tensors=1), "tensor 'w' starts at offset 4, not a multiple"),
    (_header(infos=_info("w", (48, 2), ggml_type=8), n_tensors=1), "'w' \\(q8_0\\) has rows of 48 values"),
    (_header(infos=_info("w", (4,), ggml_type=99), n_tensors=1), "'w' has an unknown ggml type 99"),
    (_header(infos=_info("w", (4,)) * 2, n_tensors=2), "tensor 'w' appears twice"),
    (_header(_string("a") + struct.pack("<IQ", 8, 2**62), n_fields=1), "metadata 'a': a string runs past the end"),
])
def test_corrupt_headers_are_refused_naming_what_is_wrong(tmp_path, data: bytes, message: str) -> None:
    (tmp_path / "bad.gguf").write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=message):
        GGUFFile(tmp_path / "bad.gguf")
    assert time.perf_counter() - start < 0.5


def test_every_corruption_of_a_header_is_a_model_load_error_or_a_loadable_file(tmp_path) -> None:
    """Random bytes of the header overwritten, a truncation anywhere: never another exception, never a crash."""
    good = tiny_gguf(tmp_path / "good.gguf").read_bytes()
    header = len(good) - sum(t.nbytes for t in GGUFFile(tmp_path / "good.gguf").tensors) - 64
    rng = random.Random(0)
    for case in range(300):
        data = bytearray(good)
        if case % 3 == 0:
            data = data[: rng.randrange(len(good))]
        else:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(header)] = rng.randrange(256)
        path = tmp_path / f"case{case}.gguf"
        path.write_bytes(bytes(data))
        try:
            open_checkpoint(path)
        except ModelLoadError:
            pass
        path.unlink()


# ---- memory: the file is mapped, not converted --------------------------------

MEASURE = """
import json, os, resource, sys
import torch, transformers
from asyncinfer import AsyncEngine
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
baseline = rss()
engine = AsyncEngine.from_pretrained(sys.argv[1], kv_cache_memory=16 << 20, max_model_len=256)
def peak():  # VmHWM: this process's own high-water RSS (ru_maxrss keeps the forking parent's, the test suite's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
print(json.dumps({"baseline": baseline, "peak": peak(),
                  "kv": engine.memory_plan.kv_bytes, "quantization": engine.config.quantization}))
"""


def test_loading_holds_the_file_once_peak_rss_within_file_size_plus_kv_plus_300_mib(tmp_path) -> None:
    """A 179 MiB Q4_1 file (Llama-shaped, 1B's widths, 4 layers, 8192 tokens): converting through float32 held
    its 1.0 GiB of float32 weights before the format was even applied; building each layer from the mapped blocks
    stays within the bound (the float32 embedding, 64 MiB, and the engine's 128 MiB bandwidth probe included)."""
    shape = dict(SHAPES["1b"], layers=4, vocab_size=8192)
    path = tmp_path / "mid.gguf"
    write(path, shape, "llama", "q4_1", "q8_0", "none", 0, direct=True)
    size = path.stat().st_size
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "ASYNCINFER_PROGRESS": "0"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["quantization"] == "q4_1"
    above = result["peak"] - result["baseline"]
    assert above <= size + result["kv"] + 300 * 2**20, (above / 2**20, size / 2**20)


@pytest.mark.parametrize(("kind", "head", "expected"), [
    ("q4_1", "q8_0", "q4_1"),  # the default model's layout: the head in the format's own head format
    ("q4_0", "q8_0", "q4_0"),
    ("q8_0", "q8_0", "q8_0"),
    ("q4_1", "q4_1", "native"),  # make_gguf.py --type q4_1: the head would be rounded to Q8_0 under "q4_1"
    ("q4_0", "q4_0", "native"),
    ("q4_1", "f16", "native"),
])
def test_auto_takes_the_file_s_format_only_where_its_head_is_that_format_s_head(tmp_path, kind, head,
                                                                                  expected) -> None:
    """README/docs/formats.md: "auto" is the file's block format when every layer projection is in it and the head
    in BLOCK_HEAD_FORMAT's format for it; otherwise "native", which keeps every tensor in its own blocks."""
    from asyncinfer.models.quant import BLOCK_HEAD_FORMAT, resolve_quantization

    config = open_checkpoint(tiny_gguf(tmp_path / "m.gguf", kind, head)).config
    assert config.native_format == expected
    assert (BLOCK_HEAD_FORMAT[kind] == head) == (expected == kind)
    if kernels.available() and kernels.auto_reason() is None:
        import torch

        assert resolve_quantization("auto", torch.device("cpu"), "auto", config.native_format) == expected
