"""The SDPA backend's paged attention against a naive per-token softmax reference, and metadata validation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncinfer.errors import InvalidParameterError
from asyncinfer.models import AttentionMetadata
from asyncinfer.models.attention.sdpa import SdpaBackend, SdpaMetadata

H, KVH, D = 6, 2, 8
BLOCK = 3


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: int) -> torch.Tensor:
    """One query token [H, D] over keys/values [ctx, KVH, D], seeing positions 0..q_pos."""
    group = H // KVH
    out = torch.empty(H, D)
    for h in range(H):
        k = keys[: q_pos + 1, h // group]  # [n, D]
        v = values[: q_pos + 1, h // group]  # [n, D]
        w = torch.softmax(k @ q[h] / math.sqrt(D), dim=0)  # [n]
        out[h] = w @ v
    return out


def test_mixed_batch_matches_naive_reference():
    torch.manual_seed(0)
    rng = random.Random(0)
    num_blocks = 30
    free = list(range(num_blocks))
    rng.shuffle(free)
    k_cache = torch.randn(num_blocks, BLOCK, KVH, D)  # stale data everywhere
    v_cache = torch.randn(num_blocks, BLOCK, KVH, D)
    # (cached prefix, new tokens): two decodes, then a fresh prefill and a prefix chunk.
    plan = [(7, 1), (2, 1), (0, 5), (4, 6)]
    full_k = [torch.randn(p + n, KVH, D) for p, n in plan]
    full_v = [torch.randn(p + n, KVH, D) for p, n in plan]
    tables, slots_new = [], []
    for (prefix, new), ks, vs in zip(plan, full_k, full_v):
        table = [free.pop() for _ in range(-(-(prefix + new) // BLOCK))]
        tables.append(table)
        for pos in range(prefix + new):
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            if pos < prefix:  # the prefix is already in the cache
                k_cache.view(-1, KVH, D)[slot] = ks[pos]
                v_cache.view(-1, KVH, D)[slot] = vs[pos]
            else:
                slots_new.append(slot)
    meta = AttentionMetadata.build(
        [n for _, n in plan], [p + n for p, n in plan], tables, slots_new, BLOCK, "cpu"
    )
    assert isinstance(meta, SdpaMetadata) and isinstance(meta.backend, SdpaBackend) and meta.num_decodes == 2
    q = torch.randn(meta.num_tokens, H, D)
    k = torch.cat([ks[p:] for (p, _), ks in zip(plan, full_k)])
    v = torch.cat([vs[p:] for (p, _), vs in zip(plan, full_v)])

    out = meta.backend.forward(q, k, v, (k_cache, v_cache), meta, scale=1 / math.sqrt(D))

    assert out.shape == (meta.num_tokens, H, D)
    row = 0
    for (prefix, new), ks, vs in zip(plan, full_k, full_v):
        for j in range(new):
            expected = naive_attention(q[row], ks, vs, prefix + j)
            torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
            row += 1
    # The new keys landed in their slots.
    torch.testing.assert_close(k_cache.view(-1, KVH, D)[meta.slot_mapping], k)


def test_decode_only_batch_masks_padding_blocks():
    """Rows of different lengths share one padded block table; padding points at block 0."""
    torch.manual_seed(1)
    k_cache = torch.randn(8, BLOCK, KVH, D) * 100  # large stale values must be masked
    v_cache = torch.randn(8, BLOCK, KVH, D) * 100
    tables = [[5, 0, 3], [2]]
    ctx = [8, 2]
    slots = [3 * BLOCK + 1, 2 * BLOCK + 1]  # each sequence's last position
    meta = SdpaBackend().build_metadata(query_lens=[1, 1], context_lens=ctx, block_tables=tables,
                                        slot_mapping=slots, block_size=BLOCK, device="cpu")
    assert meta.decode_block_tables.tolist() == [[5, 0, 3], [2, 0, 0]]
    q = torch.randn(2, H, D)
    k = torch.randn(2, KVH, D)
    v = torch.randn(2, KVH, D)
    out = SdpaBackend().forward(q, k, v, (k_cache, v_cache), meta, scale=1 / math.sqrt(D))
    for i, table in enumerate(tables):
        flat_k = k_cache[table].view(-1, KVH, D)[: ctx[i]]
        flat_v = v_cache[table].view(-1, KVH, D)[: ctx[i]]
        torch.testing.assert_close(out[i], naive_attention(q[i], flat_k, flat_v, ctx[i] - 1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "args, parameter",
    [
        (([5, 1], [5, 3], [[0, 1], [2]], [0] * 6, BLOCK), "query_lens"),  # decode after a prefill
        (([1], [2], [[0]], [0, 1], BLOCK), "slot_mapping"),
        (([2], [7], [[0, 1]], [0, 1], BLOCK), "block_tables[0]"),  # 7 tokens need 3 blocks
        (([3], [2], [[0]], [0, 1, 2], BLOCK), "query_lens[0]/context_lens[0]"),
        (([1], [1], [[0]], [0], 0), "block_size"),
    ],
)
def test_build_rejects_inconsistent_lists(args, parameter):
    with pytest.raises(InvalidParameterError) as info:
        AttentionMetadata.build(*args, device="cpu")
    assert info.value.parameter == parameter


def test_build_prefill_metadata():
    meta = AttentionMetadata.build([1, 4, 2], [6, 4, 5], [[4, 1], [2, 3], [0, 7]], [10, 6, 7, 8, 9, 1, 21], BLOCK, "cpu")
    assert meta.num_decodes == 1
    assert meta.query_start_loc == [0, 1, 5, 7]
    assert meta.prefill_context_slots[0] is None  # no cached prefix: plain causal
    assert meta.prefill_context_slots[1].tolist() == [0, 1, 2, 21, 22]
    assert meta.prefill_masks[1].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert meta.decode_mask.shape == (1, 1, 1, 6)


@pytest.mark.parametrize("num_decodes", [3, 4, 9])
def test_decode_batches_match_the_reference(num_decodes):
    """Decode-only batches of several lengths (the float mask on a CPU) match the naive reference,
    with large stale values past each context that must stay masked."""
    torch.manual_seed(num_decodes)
    rng = random.Random(num_decodes)
    blocks = list(range(1, 40))
    rng.shuffle(blocks)
    k_cache = torch.randn(40, BLOCK, KVH, D) * 100
    v_cache = torch.randn(40, BLOCK, KVH, D) * 100
    ctx = [rng.randint(1, 4 * BLOCK) for _ in range(num_decodes)]
    tables = [[blocks.pop() for _ in range(-(-n // BLOCK))] for n in ctx]
    for table, n in zip(tables, ctx):  # each context's own positions hold ordinary values
        for pos in range(n):
            k_cache[table[pos // BLOCK], pos % BLOCK] = torch.randn(KVH, D)
            v_cache[table[pos // BLOCK], pos % BLOCK] = torch.randn(KVH, D)
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, ctx)]
    meta = SdpaBackend().build_metadata(query_lens=[1] * num_decodes, context_lens=ctx, block_tables=tables,
                                        slot_mapping=slots, block_size=BLOCK, device="cpu")
    q = torch.randn(num_decodes, H, D)
    k = torch.randn(num_decodes, KVH, D)
    v = torch.randn(num_decodes, KVH, D)
    out = SdpaBackend().forward(q, k, v, (k_cache, v_cache), meta, scale=1 / math.sqrt(D))
    for i, table in enumerate(tables):
        flat_k = k_cache[table].view(-1, KVH, D)[: ctx[i]]
        flat_v = v_cache[table].view(-1, KVH, D)[: ctx[i]]
        torch.testing.assert_close(out[i], naive_attention(q[i], flat_k, flat_v, ctx[i] - 1), atol=1e-4, rtol=1e-5)

