"""Inputs that once killed the process inside asyncinfer's kernels (SIGSEGV, SIGFPE, heap corruption), each
with the typed error its entry now raises and the parameter the message names; and a tiny decoder (layers of
32 hidden, 2 heads of 16, 1 KV head) to drive DecodeLayer / DecodeStack without a model.

Run as a script, it builds the kernels, runs every case in a forked child (a crash is reported as the signal
that ended the child, and the cases after it still run) and prints one JSON object: case -> outcome.
``tests/models/test_kernel_validation.py`` runs it in a subprocess and checks each outcome."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable

import torch

from asyncinfer import kernels

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, BLOCK, BLOCKS = 32, 2, 1, 16, 64, 40, 4, 8
NEAR_2_63 = 2**63 - 1


def blocks(rows: int, cols: int, fmt: str = "q4_1", seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return kernels.pack(kernels.quantize(torch.randn(rows, cols, generator=gen) * 0.1, fmt), fmt)


def layer_args(hidden: int = HIDDEN, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
               inter: int = INTER, seed: int = 0) -> dict:
    q = heads * head_dim
    return {"norm1": torch.ones(hidden), "norm2": torch.ones(hidden), "eps": 1e-5,
            "qkv": ("q4_1", blocks(q + 2 * kv_heads * head_dim, hidden, seed=seed), None),
            "o": ("q8_0", blocks(hidden, q, "q8_0", seed + 1), None),
            "gate_up": ("q4_1", blocks(2 * inter, hidden, seed=seed + 2), None),
            "down": ("q4_1", blocks(hidden, inter, seed=seed + 3), None),
            "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "intermediate_size": inter,
            "scale": head_dim**-0.5}


def mixed_qkv(seed: int = 0) -> tuple:
    """The tiny layer's q/k/v in three formats, one a run of rows (as a Q4_K_M file mixes them)."""
    kv = KV_HEADS * HEAD_DIM
    return (("q4_0", "q5_1", "q8_0"), (blocks(HEADS * HEAD_DIM, HIDDEN, "q4_0", seed), blocks(kv, HIDDEN, "q5_1", seed),
                                       blocks(kv, HIDDEN, "q8_0", seed)), None)


def tiny_layer(**over) -> kernels.DecodeLayer:
    return kernels.DecodeLayer(**{**layer_args(), **over})


def tiny_stack(layers: int = 2) -> kernels.DecodeStack:
    return kernels.DecodeStack([kernels.DecodeLayer(**layer_args(seed=3 * i)) for i in range(layers)],
                               torch.ones(HIDDEN), 1e-5, ("q8_0", blocks(VOCAB, HIDDEN, "q8_0", 99), VOCAB))


def tables(layers: int = 2, block: int = BLOCK, blocks_: int = BLOCKS) -> tuple:
    """embed [VOCAB, HIDDEN], cos / sin tables [64, HEAD_DIM / 2], one (k, v) cache pair a layer."""
    gen = torch.Generator().manual_seed(5)
    angles = torch.arange(64, dtype=torch.float32)[:, None] * torch.arange(HEAD_DIM // 2)[None] * 0.1
    caches = [(torch.zeros(blocks_, block, KV_HEADS, HEAD_DIM), torch.zeros(blocks_, block, KV_HEADS, HEAD_DIM))
              for _ in range(layers)]
    return torch.randn(VOCAB, HIDDEN, generator=gen), angles.cos().contiguous(), angles.sin().contiguous(), caches


def long(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


META = torch.device("meta")
#: A token at position 5 (slot 5) of a 6-token context in blocks 0, 1: the packed list decode_packed takes.
GOOD_PACKED = [3, 5, 5, 6, 0, 1]


def _gemm(**over):
    w = blocks(8, 64)
    args = {"x": torch.randn(2, 64), "packed": w, "fmt": "q4_1", "out_features": 8, "bias": None, **over}
    return kernels.gemm(**args)


def _attention(**over):
    cache = torch.zeros(4, 16, 1, 16)
    args = {"q": torch.zeros(1, 2, 16), "k_cache": cache, "v_cache": cache, "block_tables": long(0).view(1, 1),
            "context_lens": long(1), "scale": 1.0, **over}
    return kernels.decode_attention(**args)


def _layer_call(**over):
    layer = tiny_layer()
    _, cos, sin, caches = tables(1)
    k, v = caches[0]
    args = {"h": torch.zeros(1, HIDDEN), "cos": cos[:1], "sin": sin[:1], "k_cache": k, "v_cache": v,
            "slots": long(5), "block_tables": long(0, 1).view(1, 2), "context_lens": long(6), **over}
    return layer(**args)


def _stack_call(stack=None, **over):
    embed, cos, sin, caches = tables()
    args = {"input_ids": long(3), "embed": embed, "positions": long(5), "cos_table": cos, "sin_table": sin,
            "kv_caches": caches, "slots": long(5), "block_tables": long(0, 1).view(1, 2), "context_lens": long(6),
            **over}
    return (stack or tiny_stack())(**args)


def _packed(packed=None, num_tokens=1, width=2, stack=None, **over):
    embed, cos, sin, caches = tables()
    args = {"embed": embed, "cos_table": cos, "sin_table": sin, "kv_caches": caches, **over}
    return (stack or tiny_stack()).decode_packed(GOOD_PACKED if packed is None else packed, num_tokens, width,
                                                 **args)


def block_embed(fmt: str = "q8_0", packed: bool = False) -> kernels.BlockTable:
    """The embedding [VOCAB, HIDDEN] kept in ``fmt`` blocks (ggml's order, or the kernels' layout)."""
    rows = kernels.quantize(tables()[0], fmt)
    return kernels.BlockTable(kernels.pack(rows, fmt), fmt, packed=True) if packed else kernels.BlockTable(rows, fmt)


def _block_embed_changed(change: Callable[[kernels.BlockTable], None], packed: list[int] | None = None):
    """A stack that ran a good step from a block embedding, then that BlockTable changed in place (its
    attributes are plain): the next call checks it again and reads only what it now holds."""
    stack, table = tiny_stack(), block_embed(packed=True)
    _packed(stack=stack, embed=table)
    change(table)
    return _packed(packed, stack=stack, embed=table)


def _block_embed_cut(table: kernels.BlockTable) -> None:
    table.blocks = table.blocks[:2].clone()


def _block_embed_format(fmt: str) -> Callable[[kernels.BlockTable], None]:
    def change(table: kernels.BlockTable) -> None:
        table.fmt = fmt
    return change


def _embed_rows(**over):
    args = {"table": block_embed(), "ids": long(3, 0), "scale": 1.0, **over}
    return kernels.embed_rows(**args)


def _timed_stack():
    stack = tiny_stack()
    stack.timing = torch.zeros(4, dtype=torch.float64, device=META)
    return _packed(stack=stack)


class _Lying(list):
    """A list whose ``__len__`` says 6 while it holds 4 ints: counted by that, the kernel would read a table row
    and write an argmax past the converted buffer; decode_packed counts what it converted."""

    def __len__(self) -> int:
        return 6


def _nested(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # nested tensors are a prototype
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.zeros(s, dtype=dtype) for s in shapes])


def _freed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage freed in place (its shape kept): what a caller releasing memory early leaves."""
    t.untyped_storage().resize_(0)
    return t


def _freeing_blocks(table: kernels.BlockTable) -> kernels.BlockTable:
    """``table`` with its blocks' storage freed in place."""
    _freed(table.blocks)
    return table


def _blocks_on_meta(table: kernels.BlockTable) -> kernels.BlockTable:
    table.blocks = table.blocks.to(META)
    return table


def _shrunk(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage cut to one element in place (its shape kept)."""
    t.untyped_storage().resize_(t.element_size())
    return t


def _sparse():
    return torch.eye(4).to_sparse()


def _after_a_good_call(change: Callable[[list, torch.Tensor, torch.Tensor, torch.Tensor], dict]):
    """A stack that ran one good step, then the same caches and tables changed in place (``change`` returns
    the arguments that differ in the next call): the stack must check them again, not reuse its pointers."""
    stack = tiny_stack()
    embed, cos, sin, caches = tables()
    args = {"embed": embed, "cos_table": cos, "sin_table": sin, "kv_caches": caches}
    stack.decode_packed(GOOD_PACKED, 1, 2, **args)
    return stack.decode_packed(GOOD_PACKED, 1, 2, **{**args, **change(caches, embed, cos, sin)})


def _grown_then_called():
    stack = tiny_stack()
    embed, cos, sin, caches = tables()
    big = torch.zeros(64, BLOCK, KV_HEADS, HEAD_DIM)
    k0 = big[:BLOCKS]
    caches[0] = (k0, caches[0][1])
    args = {"embed": embed, "cos_table": cos, "sin_table": sin, "kv_caches": caches}
    stack.decode_packed(GOOD_PACKED, 1, 2, **args)
    k0.resize_(64, BLOCK, KV_HEADS, HEAD_DIM)  # same address, 64 blocks: V0 and layer 1 still hold 8
    return stack.decode_packed([3, 5, 200, 6, 50, 1], 1, 2, **args)


#: case -> (the call, the exception type it raises, a parameter name its message holds).
CASES: dict[str, tuple[Callable[[], object], type, str]] = {
    # gemm
    "gemm x on meta": (lambda: _gemm(x=torch.randn(2, 64, device=META)), TypeError, "x"),
    "gemm weights on meta": (lambda: _gemm(packed=blocks(8, 64).to(META)), TypeError, "packed"),
    "gemm bias on meta": (lambda: _gemm(bias=torch.zeros(8, device=META)), TypeError, "bias"),
    "gemm rows whose scratch overflows": (lambda: _gemm(x=torch.zeros(1, 64).expand(2**56, 64)), ValueError, "x"),
    "gemm int8 weights": (lambda: _gemm(packed=blocks(8, 64).to(torch.int8)), TypeError, "packed"),
    "gemm negative out_features": (lambda: _gemm(out_features=-1), ValueError, "out_features"),
    "gemm x not a tensor": (lambda: _gemm(x=[[0.0] * 64]), TypeError, "x"),
    "gemm fmt not a string": (lambda: _gemm(fmt=None), TypeError, "fmt"),
    "gemm q4_k inputs not a multiple of 256": (lambda: _gemm(packed=torch.zeros(8, 144, dtype=torch.uint8),
                                                             fmt="q4_k"), ValueError, "x"),
    "gemm q6_k weights of another width": (
        lambda: _gemm(x=torch.randn(2, 256), packed=torch.zeros(8, 200, dtype=torch.uint8), fmt="q6_k"), ValueError,
        "packed"),
    "gemm unknown format": (lambda: _gemm(fmt="q3_k"), ValueError, "fmt"),
    # rms_norm
    "rms_norm x on meta": (lambda: kernels.rms_norm(torch.zeros(2, 8, device=META), torch.ones(8), 1e-5),
                           TypeError, "x"),
    "rms_norm weight on meta": (lambda: kernels.rms_norm(torch.zeros(2, 8), torch.ones(8, device=META), 1e-5),
                                TypeError, "weight"),
    "rms_norm hidden 0": (lambda: kernels.rms_norm(torch.zeros(2, 3, 0), torch.ones(0), 1e-5), ValueError, "x"),
    "rms_norm rows that overflow": (lambda: kernels.rms_norm(torch.zeros(1, 8).expand(2**59, 8), torch.ones(8),
                                                             1e-5), ValueError, "x"),
    "rms_norm eps not a number": (lambda: kernels.rms_norm(torch.zeros(2, 8), torch.ones(8), "1e-5"), TypeError,
                                  "eps"),
    "rms_norm 0-dim x": (lambda: kernels.rms_norm(torch.tensor(1.0), torch.ones(()), 1e-5), TypeError, "x"),
    # decode_attention
    "attention q on meta": (lambda: _attention(q=torch.zeros(1, 2, 16, device=META)), TypeError, "q"),
    "attention caches on meta": (lambda: _attention(k_cache=torch.zeros(4, 16, 1, 16, device=META)), TypeError,
                                 "k_cache"),
    "attention tables on meta": (lambda: _attention(block_tables=long(0).view(1, 1).to(META)), TypeError,
                                 "block_tables"),
    "attention block size 0": (lambda: _attention(k_cache=torch.zeros(4, 0, 1, 16), v_cache=torch.zeros(4, 0, 1, 16)),
                               ValueError, "k_cache"),
    "attention KV heads 0": (lambda: _attention(k_cache=torch.zeros(4, 16, 0, 16), v_cache=torch.zeros(4, 16, 0, 16)),
                             ValueError, "KV heads"),
    "attention fewer heads than KV heads": (
        lambda: _attention(q=torch.zeros(1, 1, 16), k_cache=torch.zeros(4, 16, 2, 16),
                           v_cache=torch.zeros(4, 16, 2, 16)), ValueError, "heads"),
    "attention head_dim 12": (lambda: _attention(q=torch.zeros(1, 2, 12), k_cache=torch.zeros(4, 16, 1, 12),
                                                 v_cache=torch.zeros(4, 16, 1, 12)), ValueError, "head_dim"),
    "attention head_dim 0": (lambda: _attention(q=torch.zeros(1, 2, 0), k_cache=torch.zeros(4, 16, 1, 0),
                                                v_cache=torch.zeros(4, 16, 1, 0)), ValueError, "head_dim"),
    "attention context near 2**63": (lambda: _attention(context_lens=long(NEAR_2_63)), IndexError, "context_lens"),
    "attention more context lengths than rows": (lambda: _attention(context_lens=long(1, 1)), TypeError,
                                                 "context_lens"),
    "attention more table rows than rows": (lambda: _attention(block_tables=long(0, 0).view(2, 1)), TypeError,
                                            "block_tables"),
    "attention non-contiguous cache": (lambda: _attention(k_cache=torch.zeros(4, 16, 2, 16)[:, :, :1]), TypeError,
                                       "k_cache"),
    # argmax and the formats
    "argmax x on meta": (lambda: kernels.argmax(torch.zeros(2, 8, device=META)), TypeError, "x"),
    "argmax sparse x": (lambda: kernels.argmax(_sparse()), TypeError, "x"),
    "quantize weight on meta": (lambda: kernels.quantize(torch.zeros(2, 32, device=META), "q4_1"), TypeError,
                                "weight"),
    "pack blocks on meta": (lambda: kernels.pack(torch.zeros(2, 20, dtype=torch.uint8, device=META), "q4_1"),
                            TypeError, "blocks"),
    "dequantize int64 blocks": (lambda: kernels.dequantize(torch.zeros(2, 34, dtype=torch.int64), "q8_0"),
                                TypeError, "blocks"),
    # DecodeLayer construction
    "layer 0 KV heads": (lambda: tiny_layer(num_kv_heads=0), ValueError, "num_kv_heads"),
    "layer fewer heads than KV heads": (lambda: tiny_layer(num_heads=1, num_kv_heads=2), ValueError,
                                        "num_heads"),
    "layer head_dim 12": (lambda: tiny_layer(head_dim=12), ValueError, "head_dim"),
    "layer norm1 on meta": (lambda: tiny_layer(norm1=torch.ones(HIDDEN, device=META)), TypeError, "norm1"),
    "layer norm2 of another size": (lambda: tiny_layer(norm2=torch.ones(HIDDEN + 1)), TypeError, "norm2"),
    "layer qkv weights for more heads": (lambda: tiny_layer(num_heads=4), ValueError, "qkv"),
    "layer intermediate_size that disagrees with gate_up": (lambda: tiny_layer(intermediate_size=32), ValueError, "gate_up"),
    "layer bias on o": (lambda: tiny_layer(o=("q8_0", blocks(HIDDEN, HEADS * HEAD_DIM, "q8_0"), torch.zeros(HIDDEN))),
                        ValueError, "o"),
    "layer qkv bias on meta": (lambda: tiny_layer(qkv=("q4_1", blocks(64, HIDDEN), torch.zeros(64, device=META))),
                               TypeError, "qkv bias"),
    "layer intermediate_size 0": (lambda: tiny_layer(intermediate_size=0), ValueError, "intermediate_size"),
    "layer qkv not a tuple": (lambda: tiny_layer(qkv=None), TypeError, "qkv"),
    "layer q_norm without k_norm": (lambda: tiny_layer(q_norm=torch.ones(HEAD_DIM)), ValueError, "q_norm"),
    "layer q_norm of hidden's size": (lambda: tiny_layer(q_norm=torch.ones(HIDDEN), k_norm=torch.ones(HEAD_DIM)),
                                      ValueError, "q_norm"),
    "layer k_norm on meta": (lambda: tiny_layer(q_norm=torch.ones(HEAD_DIM), k_norm=torch.ones(HEAD_DIM, device=META)),
                             TypeError, "k_norm"),
    "layer k_norm float64": (lambda: tiny_layer(q_norm=torch.ones(HEAD_DIM), k_norm=torch.ones(HEAD_DIM).double()),
                             TypeError, "k_norm"),
    "layer qkv parts that do not add up": (
        lambda: tiny_layer(qkv=(("q4_0", "q8_0"), (blocks(HEADS * HEAD_DIM, HIDDEN, "q4_0"), blocks(8, HIDDEN, "q8_0")),
                                None)), ValueError, "qkv"),
    "layer qkv part of an unknown format": (
        lambda: tiny_layer(qkv=(("q4_0", "q9"), mixed_qkv()[1][:2], None)), ValueError, "qkv[1]"),
    "layer qkv formats without as many blocks": (lambda: tiny_layer(qkv=(("q4_0", "q8_0"), blocks(64, HIDDEN), None)),
                                                 TypeError, "qkv"),
    "layer qkv of four parts": (lambda: tiny_layer(qkv=(("q4_0",) * 4, (blocks(16, HIDDEN, "q4_0"),) * 4, None)),
                                TypeError, "qkv"),
    "layer qkv part on meta": (
        lambda: tiny_layer(qkv=(mixed_qkv()[0], (*mixed_qkv()[1][:2], blocks(16, HIDDEN, "q8_0").to(META)), None)),
        TypeError, "qkv[2]"),
    # DecodeLayer's Gemma parameters
    "layer post_norm1 of another size": (lambda: tiny_layer(post_norm1=torch.ones(HIDDEN + 1)), TypeError, "post_norm1"),
    "layer post_norm2 float64": (lambda: tiny_layer(post_norm2=torch.ones(HIDDEN, dtype=torch.float64)), TypeError,
                                 "post_norm2"),
    "layer activation unknown": (lambda: tiny_layer(activation="relu"), ValueError, "activation"),
    "layer attn_softcap 0": (lambda: tiny_layer(attn_softcap=0.0), ValueError, "attn_softcap"),
    "layer attn_softcap NaN": (lambda: tiny_layer(attn_softcap=float("nan")), ValueError, "attn_softcap"),
    "layer attn_softcap a string": (lambda: tiny_layer(attn_softcap="2"), TypeError, "attn_softcap"),
    "layer rope_table beyond the tables": (lambda: tiny_layer(rope_table=kernels.MAX_ROPE_TABLES), ValueError,
                                           "rope_table"),
    "layer window 0": (lambda: tiny_layer(window=0), ValueError, "window"),
    "layer window a float": (lambda: tiny_layer(window=8.0), TypeError, "window"),
    # DecodeLayer call
    "layer h on meta": (lambda: _layer_call(h=torch.zeros(1, HIDDEN, device=META)), TypeError, "h"),
    "layer slots on meta": (lambda: _layer_call(slots=long(5).to(META)), TypeError, "slots"),
    "layer context rows disagree with h": (lambda: _layer_call(h=torch.zeros(2, HIDDEN), cos=tables()[1][:2],
                                                               sin=tables()[2][:2], slots=long(5, 6)),
                                           ValueError, "context_lens"),
    "layer context near 2**63": (lambda: _layer_call(context_lens=long(NEAR_2_63)), IndexError, "context_lens"),
    "layer block size 0": (lambda: _layer_call(k_cache=torch.zeros(8, 0, KV_HEADS, HEAD_DIM),
                                               v_cache=torch.zeros(8, 0, KV_HEADS, HEAD_DIM)), ValueError, "k_cache"),
    "layer caches of other KV heads": (lambda: _layer_call(k_cache=torch.zeros(8, BLOCK, 2, HEAD_DIM),
                                                           v_cache=torch.zeros(8, BLOCK, 2, HEAD_DIM)),
                                       ValueError, "k_cache"),
    # DecodeStack construction
    "stack of layers of different widths": (
        lambda: kernels.DecodeStack([tiny_layer(), kernels.DecodeLayer(**layer_args(hidden=64))], torch.ones(HIDDEN),
                                    1e-5), ValueError, "layers[1]"),
    "stack of layers of different head_dim": (
        lambda: kernels.DecodeStack([tiny_layer(), kernels.DecodeLayer(**layer_args(heads=1, head_dim=32))],
                                    torch.ones(HIDDEN), 1e-5), ValueError, "layers[1]"),
    "stack of layers of different KV heads": (
        lambda: kernels.DecodeStack([tiny_layer(), kernels.DecodeLayer(**layer_args(kv_heads=2))],
                                    torch.ones(HIDDEN), 1e-5), ValueError, "layers[1]"),
    "stack final_norm of another size": (lambda: kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN - 1), 1e-5),
                                         TypeError, "final_norm"),
    "stack head on meta": (lambda: kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN), 1e-5,
                                                       ("q8_0", blocks(VOCAB, HIDDEN, "q8_0").to(META), VOCAB)),
                           TypeError, "head"),
    "stack head of 0 outputs": (lambda: kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN), 1e-5,
                                                            ("q8_0", torch.zeros(0, 34, dtype=torch.uint8), 0)),
                                ValueError, "out_features"),
    "stack of something else": (lambda: kernels.DecodeStack([None], torch.ones(HIDDEN), 1e-5), TypeError,
                                "layers[0]"),
    "stack of no layers": (lambda: kernels.DecodeStack([], torch.ones(HIDDEN), 1e-5), ValueError, "layers"),
    # DecodeStack call and decode_packed
    "stack caches on meta": (lambda: _stack_call(kv_caches=[(torch.zeros(8, BLOCK, 1, 16, device=META),) * 2] * 2),
                             TypeError, "kv_caches[0][0]"),
    "stack cos_table on meta": (lambda: _stack_call(cos_table=tables()[1].to(META)), TypeError, "cos_table"),
    "stack embed on meta": (lambda: _stack_call(embed=tables()[0].to(META)), TypeError, "embed"),
    "stack block size 0": (lambda: _stack_call(kv_caches=tables(block=0)[3]), ValueError, "kv_caches[0][0]"),
    "stack context near 2**63": (lambda: _stack_call(context_lens=long(NEAR_2_63)), IndexError, "context_lens"),
    "stack slots rows disagree": (lambda: _stack_call(slots=long(5, 6)), TypeError, "slots"),
    "stack positions on meta": (lambda: _stack_call(positions=long(5).to(META)), TypeError, "positions"),
    "packed context near 2**63": (lambda: _packed([3, 5, 5, NEAR_2_63, 0, 1]), IndexError, "context_lens"),
    "packed int beyond int64": (lambda: _packed([3, 5, 5, 2**64 + 6, 0, 1]), ValueError, "packed"),
    "packed int below int64": (lambda: _packed([3, -(2**70), 5, 6, 0, 1]), ValueError, "packed"),
    "packed float": (lambda: _packed([3, 5, 5, 6.0, 0, 1]), TypeError, "packed"),
    "packed num_tokens a float": (lambda: _packed(num_tokens=1.0), TypeError, "num_tokens"),
    "packed a list whose __len__ lies": (lambda: _packed(_Lying([3, 5, 5, 6])), ValueError, "packed"),
    "packed width 0": (lambda: _packed([3, 5, 5, 6], width=0), ValueError, "width"),
    "packed block size 0": (lambda: _packed(kv_caches=tables(block=0)[3]), ValueError, "kv_caches[0][0]"),
    "packed caches on meta": (lambda: _packed(kv_caches=[(torch.zeros(8, BLOCK, 1, 16, device=META),) * 2] * 2),
                              TypeError, "kv_caches[0][0]"),
    "packed timing on meta": (_timed_stack, TypeError, "timing"),
    "stack step of no tokens": (lambda: _stack_call(input_ids=long(), positions=long(), slots=long(),
                                                    context_lens=long(), block_tables=long().view(0, 2)),
                                ValueError, "input_ids"),
    "stack cache storage replaced in place": (
        lambda: _after_a_good_call(lambda caches, *_: (caches[1][0].set_(torch.zeros(1)), {})[1]), TypeError,
        "kv_caches"),
    "stack layer 0 cache grown in place": (_grown_then_called, TypeError, "kv_caches"),
    "stack sin table cut after a call": (lambda: _after_a_good_call(lambda c, e, cos, sin: {"sin_table": sin[:1]}),
                                         TypeError, "sin_table"),
    "stack sin table of another dtype after a call": (
        lambda: _after_a_good_call(lambda c, e, cos, sin: {"sin_table": sin.view(torch.int32)}), TypeError,
        "sin_table"),
    # an embedding kept in blocks (BlockTable), the step's rows dequantized by the kernel; its scale
    "stack token id beyond a block embedding": (lambda: _stack_call(input_ids=long(VOCAB), embed=block_embed()),
                                                IndexError, "input_ids"),
    "packed negative token id, block embedding in the kernels' layout": (
        lambda: _packed([-1, 5, 5, 6, 0, 1], embed=block_embed(packed=True)), IndexError, "input_ids"),
    "packed token id near 2**63, q4_0 embedding": (
        lambda: _packed([NEAR_2_63, 5, 5, 6, 0, 1], embed=block_embed("q4_0")), IndexError, "input_ids"),
    "stack block embedding of another width": (
        lambda: _stack_call(embed=kernels.BlockTable(kernels.quantize(torch.zeros(VOCAB, 2 * HIDDEN), "q8_0"), "q8_0")),
        TypeError, "embed"),
    "stack block embedding moved to meta": (lambda: _stack_call(embed=_blocks_on_meta(block_embed())), TypeError,
                                            "embed.blocks"),
    "stack block embedding with freed storage": (
        lambda: _stack_call(embed=_freeing_blocks(block_embed())), ValueError, "embed.blocks"),
    "stack block embedding cut to 2 rows after a call": (
        lambda: _block_embed_changed(_block_embed_cut), IndexError, "input_ids"),
    "stack block embedding of an unknown format after a call": (
        lambda: _block_embed_changed(_block_embed_format("q3_k")), ValueError, "embed's format"),
    "stack block embedding whose rows are no whole blocks of its new format": (
        lambda: _block_embed_changed(_block_embed_format("q4_1")), TypeError, "embed.blocks"),
    "stack block embedding's blocks freed after a call": (
        lambda: _block_embed_changed(_freeing_blocks), ValueError, "embed.blocks"),
    "stack block embedding's blocks replaced by a list after a call": (
        lambda: _block_embed_changed(lambda t: setattr(t, "blocks", [0] * 40)), TypeError, "embed.blocks"),
    "stack embed_scale NaN": (lambda: kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN), 1e-5,
                                                          embed_scale=float("nan")), ValueError, "embed_scale"),
    "stack embed_scale beyond float32": (lambda: kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN), 1e-5,
                                                                     embed_scale=1e39), ValueError, "embed_scale"),
    "stack embed_scale a tensor": (lambda: kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN), 1e-5,
                                                               embed_scale=torch.tensor(2.0)), TypeError, "embed_scale"),
    "stack logit_softcap negative": (lambda: kernels.DecodeStack([tiny_layer()], torch.ones(HIDDEN), 1e-5,
                                                                 logit_softcap=-1.0), ValueError, "logit_softcap"),
    "stack of a second rope table called with one": (
        lambda: _stack_call(kernels.DecodeStack([tiny_layer(), tiny_layer(rope_table=1)], torch.ones(HIDDEN), 1e-5)),
        TypeError, "cos_table"),
    "stack second rope table of another size": (
        lambda: _stack_call(kernels.DecodeStack([tiny_layer(), tiny_layer(rope_table=1)], torch.ones(HIDDEN), 1e-5),
                            cos_table=(tables()[1], tables()[1][:32]), sin_table=(tables()[2],) * 2),
        TypeError, "cos_table[1]"),
    "embed_rows id beyond the table": (lambda: _embed_rows(ids=long(0, VOCAB)), IndexError, "ids"),
    "embed_rows ids on meta": (lambda: _embed_rows(ids=long(1).to(META)), TypeError, "ids"),
    "embed_rows ids of two dimensions": (lambda: _embed_rows(ids=long(1, 2).view(1, 2)), TypeError, "ids"),
    "embed_rows ids that overflow its output": (lambda: _embed_rows(ids=long(0).expand(2**60)), ValueError, "ids"),
    "embed_rows a float16 table": (lambda: _embed_rows(table=tables()[0].half()), TypeError, "table"),
    "embed_rows a table of overlapping rows": (lambda: _embed_rows(table=torch.zeros(1, HIDDEN).expand(VOCAB, HIDDEN)),
                                               TypeError, "table"),
    "embed_rows a table with freed storage": (lambda: _embed_rows(table=_freed(tables()[0])), ValueError, "table"),
    "embed_rows blocks of a 0-wide table": (
        lambda: _embed_rows(table=kernels.BlockTable(torch.zeros(VOCAB, 0, dtype=torch.uint8), "q8_0")), TypeError,
        "table"),
    "embed_rows scale infinite": (lambda: _embed_rows(scale=float("inf")), ValueError, "scale"),
    "attention context lengths of two dimensions": (lambda: _attention(context_lens=long(1).view(1, 1)), TypeError,
                                                    "context_lens"),
    # storage freed in place (``untyped_storage().resize_(0)``): the tensor keeps its shape, its data pointer is 0
    "gemm x with freed storage": (lambda: _gemm(x=_freed(torch.randn(2, 64))), ValueError, "x"),
    "gemm weights with freed storage": (lambda: _gemm(packed=_freed(blocks(8, 64))), ValueError, "packed"),
    "rms_norm x with freed storage": (lambda: kernels.rms_norm(_freed(torch.randn(64, 64)), torch.ones(64), 1e-5),
                                      ValueError, "x"),
    "rms_norm weight with freed storage": (lambda: kernels.rms_norm(torch.randn(2, 64), _freed(torch.ones(64)),
                                                                    1e-5), ValueError, "weight"),
    "argmax x with freed storage": (lambda: kernels.argmax(_freed(torch.randn(64, 64))), ValueError, "x"),
    "attention cache with freed storage": (lambda: _attention(k_cache=_freed(torch.zeros(4, 16, 1, 16))), ValueError,
                                           "k_cache"),
    "attention context_lens with freed storage": (lambda: _attention(context_lens=_freed(long(1))), ValueError,
                                                  "context_lens"),
    "layer slots with freed storage": (lambda: _layer_call(slots=_freed(long(5))), ValueError, "slots"),
    "layer h with storage shrunk": (lambda: _layer_call(h=_shrunk(torch.zeros(1, HIDDEN))), ValueError, "h"),
    "stack positions with freed storage": (lambda: _stack_call(positions=_freed(long(5))), ValueError, "positions"),
    "stack table row with freed storage": (lambda: _stack_call(block_tables=_freed(long(0, 1).view(1, 2))),
                                           ValueError, "block_tables"),
    "stack embed with freed storage": (lambda: _stack_call(embed=_freed(tables()[0])), ValueError, "embed"),
    "stack cache freed after a call": (
        lambda: _after_a_good_call(lambda caches, *_: (_freed(caches[1][0]), {})[1]), ValueError, "kv_caches[1][0]"),
    "stack embed freed after a call": (lambda: _after_a_good_call(lambda c, embed, *_: (_freed(embed), {})[1]),
                                       ValueError, "embed"),
    # nested tensors (strided layout, no single shape)
    "gemm x nested": (lambda: _gemm(x=_nested((2, 64), (3, 64))), TypeError, "x"),
    "rms_norm x nested": (lambda: kernels.rms_norm(_nested((2, 8), (3, 8)), torch.ones(8), 1e-5), TypeError, "x"),
    "argmax x nested": (lambda: kernels.argmax(_nested((2, 8), (3, 8))), TypeError, "x"),
    "attention q nested": (lambda: _attention(q=_nested((2, 16), (2, 16))), TypeError, "q"),
    "quantize weight nested": (lambda: kernels.quantize(_nested((2, 32), (3, 32)), "q4_1"), TypeError, "weight"),
    "stack input_ids nested": (lambda: _stack_call(input_ids=_nested((1,), dtype=torch.int64)), TypeError,
                               "input_ids"),
    # lazily negated views (``z.conj().imag`` of a complex z): their memory holds the values unnegated
    "gemm x a negated view": (lambda: _gemm(x=torch.randn(2, 64, dtype=torch.cfloat).conj().imag), TypeError, "x"),
    "gemm bias a negated view": (lambda: _gemm(bias=torch.randn(8, dtype=torch.cfloat).conj().imag), TypeError,
                                 "bias"),
    "rms_norm x a negated view": (lambda: kernels.rms_norm(torch.randn(2, 8, dtype=torch.cfloat).conj().imag,
                                                           torch.ones(8), 1e-5), TypeError, "x"),
    "argmax x a negated view": (lambda: kernels.argmax(torch.randn(2, 8, dtype=torch.cfloat).conj().imag),
                                TypeError, "x"),
    "attention q a negated view": (lambda: _attention(q=torch.randn(1, 2, 16, dtype=torch.cfloat).conj().imag),
                                   TypeError, "q"),
}

#: Empty inputs the kernels take: case -> (the call, a check of what it returns).
EMPTIES: dict[str, tuple[Callable[[], object], Callable[[object], bool]]] = {
    "gemm of no rows": (lambda: _gemm(x=torch.zeros(0, 64)), lambda y: y.shape == (0, 8)),
    "gemm q4_k of no rows": (lambda: _gemm(x=torch.zeros(0, 256), packed=blocks(8, 256, "q4_k"), fmt="q4_k"),
                             lambda y: y.shape == (0, 8)),
    "quantize q6_k of no rows": (lambda: kernels.quantize(torch.zeros(0, 512), "q6_k"), lambda y: y.shape == (0, 420)),
    "gemm of no outputs": (lambda: _gemm(packed=torch.zeros(0, 40, dtype=torch.uint8), out_features=0),
                           lambda y: y.shape == (2, 0)),
    "rms_norm of no rows": (lambda: kernels.rms_norm(torch.zeros(0, 8), torch.ones(8), 1e-5),
                            lambda y: y.shape == (0, 8)),
    "attention of no sequences": (lambda: _attention(q=torch.zeros(0, 2, 16), block_tables=long().view(0, 1),
                                                     context_lens=long()), lambda y: y.shape == (0, 2, 16)),
    "argmax of no rows": (lambda: kernels.argmax(torch.zeros(0, 5)), lambda y: y == []),
    "quantize of no rows": (lambda: kernels.quantize(torch.zeros(0, 64), "q4_1"), lambda y: y.shape == (0, 40)),
    "pack of no rows": (lambda: kernels.pack(torch.zeros(0, 34, dtype=torch.uint8), "q8_0"),
                        lambda y: y.shape == (0, 34)),
    "dequantize of no rows": (lambda: kernels.dequantize(torch.zeros(0, 40, dtype=torch.uint8), "q4_1"),
                              lambda y: y.shape == (0, 64)),
    "embed_rows of no ids": (lambda: _embed_rows(ids=long()), lambda y: y.shape == (0, HIDDEN)),
    "embed_rows of a table of no rows": (lambda: _embed_rows(table=torch.zeros(0, HIDDEN), ids=long()),
                                         lambda y: y.shape == (0, HIDDEN)),
    "layer step of no tokens": (lambda: _layer_call(h=torch.zeros(0, HIDDEN), cos=torch.zeros(0, 8),
                                                    sin=torch.zeros(0, 8), slots=long(),
                                                    block_tables=long().view(0, 2), context_lens=long()),
                                lambda y: y.shape == (0, HIDDEN)),
}


def _layer_out(layer: kernels.DecodeLayer) -> torch.Tensor:
    _, cos, sin, caches = tables(1)
    k, v = caches[0]
    return layer(torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1)), cos[5:6], sin[5:6], k, v,
                 long(5), long(0, 1).view(1, 2), long(6))


def _layer_weights_replaced() -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's output, and the output of the same layer built from other tensors whose storage was then
    replaced (``set_``) and dropped by the caller: the layer holds what its pointers address."""
    expected = _layer_out(tiny_layer())
    args = layer_args()
    layer = kernels.DecodeLayer(**args)
    for t in (args["norm1"], args["norm2"], *(args[n][1] for n in ("qkv", "o", "gate_up", "down"))):
        t.set_(torch.empty(0, dtype=t.dtype))
    del args
    return _layer_out(layer), expected


def _head_replaced() -> tuple[torch.Tensor, torch.Tensor]:
    """A stack's logits, and those of the same stack after the caller replaced its head blocks' storage."""
    expected = _packed(stack=tiny_stack())[0]
    head = blocks(VOCAB, HIDDEN, "q8_0", 99)
    stack = kernels.DecodeStack(list(tiny_stack().layers), torch.ones(HIDDEN), 1e-5, ("q8_0", head, VOCAB))
    head.set_(torch.empty(0, dtype=torch.uint8))
    del head
    return _packed(stack=stack)[0], expected


def _norms_freed() -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's output, and the same layer's after the caller freed its norms' and q/k/v bias's storage in
    place: the layer holds copies of them (a few KB; the blocks it shares, see docs/api.md)."""
    bias = torch.randn(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(2))
    expected = _layer_out(tiny_layer(qkv=(*layer_args()["qkv"][:2], bias.clone())))
    args = layer_args()
    args["qkv"] = (*args["qkv"][:2], bias)
    layer = kernels.DecodeLayer(**args)
    for t in (args["norm1"], args["norm2"], bias):
        _freed(t)
    return _layer_out(layer), expected


def _final_norm_freed() -> tuple[torch.Tensor, torch.Tensor]:
    """A stack's logits, and the same stack's after the caller freed its final norm's storage in place."""
    expected = _packed(stack=tiny_stack())[0]
    norm = torch.ones(HIDDEN)
    stack = kernels.DecodeStack(list(tiny_stack().layers), norm, 1e-5, tiny_stack().head)
    _freed(norm)
    return _packed(stack=stack)[0], expected


def _block_embed_equals_float() -> tuple[torch.Tensor, torch.Tensor]:
    """A stack's logits from a block embedding (the kernels' layout) and from the float32 table of its values, with
    the scale applied by the call and by the caller: the same."""
    table = block_embed(packed=True)
    stack = kernels.DecodeStack(list(tiny_stack().layers), torch.ones(HIDDEN), 1e-5, tiny_stack().head,
                                embed_scale=3.0)
    values = kernels.dequantize(kernels.unpack(table.blocks, "q8_0"), "q8_0")
    return _packed(stack=stack, embed=table)[0], _packed(embed=values * 3.0)[0]


def _rebind() -> bool:
    """A stack's layers and head cannot be swapped under the kernel array built from them."""
    stack = tiny_stack()
    try:
        stack.head = ("q8_0", torch.zeros(1, 34, dtype=torch.uint8), 10**6)  # type: ignore[misc]
    except AttributeError:
        return isinstance(stack.layers, tuple)
    return False


#: Calls after the caller changed what a DecodeLayer / DecodeStack was built from: case -> (the call, a check).
HELD: dict[str, tuple[Callable[[], object], Callable[[object], bool]]] = {
    "layer weights replaced after build": (_layer_weights_replaced, lambda pair: torch.equal(*pair)),
    "stack head replaced after build": (_head_replaced, lambda pair: torch.equal(*pair)),
    "stack layers and head are read-only": (_rebind, lambda ok: ok is True),
    "layer norms and bias freed after build": (_norms_freed, lambda pair: torch.equal(*pair)),
    "stack final norm freed after build": (_final_norm_freed, lambda pair: torch.equal(*pair)),
    "stack block embedding and its scale": (_block_embed_equals_float, lambda pair: torch.equal(*pair)),
}


def run_forked(fn: Callable[[], object]) -> dict:
    """Run ``fn`` in a forked child: {"signal": name} when a signal ended it, {"exit": code} when it exited
    otherwise, else {"raised": type name, "message": ...} or {"returned": True}."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one thread, no OpenMP team across the fork
        os.close(read)
        torch.set_num_threads(1)
        try:
            fn()
            out = {"returned": True}
        except BaseException as exc:  # noqa: BLE001  (reported to the parent, which judges it)
            out = {"raised": type(exc).__name__, "message": str(exc)}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": signal.Signals(os.WTERMSIG(status)).name}
    if os.WEXITSTATUS(status) or not chunks:
        return {"exit": os.WEXITSTATUS(status)}
    return json.loads(b"".join(chunks))


def _returns(fn: Callable[[], object], ok: Callable[[object], bool]) -> None:
    """Raise unless ``fn()`` returns what ``ok`` accepts."""
    out = fn()
    if not ok(out):
        raise AssertionError(f"returned {out!r}")


def main() -> None:
    assert kernels.available(), kernels.unavailable_reason()
    tiny_stack()  # built once here, before any fork
    results = {name: run_forked(fn) for name, (fn, _, _) in CASES.items()}
    results.update({name: run_forked(lambda fn=fn, ok=ok: _returns(fn, ok))
                    for name, (fn, ok) in (*EMPTIES.items(), *HELD.items())})
    results["a real crash (the harness's own check)"] = run_forked(lambda: os.kill(os.getpid(), signal.SIGSEGV))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
