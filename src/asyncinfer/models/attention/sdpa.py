"""The first attention backend, "sdpa": paged attention in plain torch over
``F.scaled_dot_product_attention`` (see :mod:`asyncinfer.models.attention.base`
for the contract).

One engine step runs a single forward over ``T`` new tokens that belong to
``S`` sequences: first ``num_decodes`` sequences with exactly one new token
each, then sequences with a prefill chunk (one or more tokens, possibly on top
of a prefix already in the cache). Tokens are concatenated, never padded.

KV cache layout (``KVCacheSpec.layer_shape``; per layer, one tensor for K and one for V)::

    [num_blocks, block_size, num_kv_heads, head_dim]

A token's *slot* is ``block_id * block_size + offset``; viewing a cache as
``[num_blocks * block_size, num_kv_heads, head_dim]`` makes the slot a plain
row index, which is how new keys/values are written (one ``index_copy_``).
Block 0 is an ordinary block; padding entries in block tables point at it and
are masked out.

Allocate caches with ``torch.zeros``, never ``torch.empty``: decodes read whole
blocks and masked slots still enter SDPA with weight 0, and 0 * NaN is NaN.
Stale (finite) data from freed blocks is harmless.

``SdpaBackend.build_metadata`` creates every tensor once per step; all layers
share it, so the per-layer work is only the attention itself. The decodes are
one batched call padded to the longest decode context (rounded up to whole
blocks): ``SdpaBackend.decode_padding`` says how many keys that costs.

A layer with a sliding window or soft-capped scores (``forward``'s ``window`` and ``softcap``) gets
masks that also hide the keys before its window, built on the first such layer of a step and kept in
the metadata for the others (one set per window); where every context of the step fits in the window
the window hides nothing and the plain path runs. Soft-capping has no SDPA form: those layers compute
the scores, cap them, mask and softmax in float32 as transformers' eager attention does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from asyncinfer.errors import InvalidParameterError
from asyncinfer.models.attention.base import AttentionBackend, AttentionMetadata
from asyncinfer.models.attention.padding import flat_padded_tables, pad_to_longest_block

KVCache = tuple[torch.Tensor, torch.Tensor]


class SdpaBackend(AttentionBackend):
    """Paged attention through torch's SDPA: one batched call for the decodes, one causal call per prefill chunk."""

    name = "sdpa"
    device_types = ("cpu", "cuda")
    #: Decodes through a kernel that reads K/V blocks in place instead of gathering them, so the metadata
    #: builds no decode masks: fixed by the class. :class:`KernelDecodeSdpaBackend`'s is asyncinfer's CPU
    #: kernel (:func:`asyncinfer.kernels.decode_attention`, in this class's ``forward``); a subclass with its
    #: own kernel overrides ``forward`` (the Triton backend, :mod:`asyncinfer.models.attention.triton_backend`).
    decodes_in_kernel: ClassVar[bool] = False

    def build_metadata(
        self,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        block_size: int,
        device: torch.device | str,
    ) -> SdpaMetadata:
        """Validate the step's Python lists and create every tensor attention needs (see the contract).

        Raises:
            InvalidParameterError: inconsistent lists (see :func:`_validate`).
        """
        _validate(query_lens, context_lens, block_tables, slot_mapping, block_size)
        device = torch.device(device)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        if self.decodes_in_kernel and num_decodes == len(query_lens) and num_decodes:
            return self._kernel_decodes(context_lens, block_tables, slot_mapping, block_size, device)
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        tables = _padded_tables(block_tables, device)  # [num_seqs, width]
        decode_context_lens, decode_block_tables, decode_mask, decode_bias = _decode_inputs(
            context_lens[:num_decodes], tables, block_size, device, masks=not self.decodes_in_kernel
        )
        prefill_slots, prefill_masks = _prefill_inputs(query_lens, context_lens, tables, num_decodes, block_size, device)
        return SdpaMetadata(
            backend=self,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),  # [num_tokens]
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            query_start_loc=query_start_loc,
            block_tables=tables,
            block_size=block_size,
            num_decodes=num_decodes,
            decode_context_lens=decode_context_lens,
            decode_block_tables=decode_block_tables,
            decode_mask=decode_mask,
            decode_bias=decode_bias,
            prefill_context_slots=prefill_slots,
            prefill_masks=prefill_masks,
            max_context_len=max(context_lens, default=0),
        )

    def _kernel_decodes(self, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                        slot_mapping: Sequence[int], block_size: int, device: torch.device) -> SdpaMetadata:
        """A step of decodes only, on asyncinfer's kernel (no masks, no prefill inputs): the slots, the
        context lengths and the block tables, each a view of one tensor (one copy from Python, not three)."""
        num_seqs = len(context_lens)
        width, padded = flat_padded_tables(block_tables)
        slots, lens, tables = torch.tensor([*slot_mapping, *context_lens, *padded], dtype=torch.long,
                                           device=device).split([num_seqs, num_seqs, num_seqs * width])
        tables = tables.view(num_seqs, width)  # [num_seqs, width], padded with block 0
        return SdpaMetadata(
            backend=self,
            slot_mapping=slots,  # [num_tokens]
            query_lens=[1] * num_seqs,
            context_lens=list(context_lens),
            query_start_loc=list(range(num_seqs + 1)),
            block_tables=tables,
            block_size=block_size,
            num_decodes=num_seqs,
            decode_context_lens=lens,  # [num_seqs]
            decode_block_tables=tables,  # every decode reads as many blocks as the longest
            decode_mask=None,
            decode_bias=None,
            prefill_context_slots=[],
            prefill_masks=[],
            max_context_len=max(context_lens, default=0),
        )

    def forward(  # type: ignore[override]  # takes the metadata this backend builds
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: SdpaMetadata, scale: float,
        *, window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache, then attend every query over its sequence's context (within
        ``window`` keys, with scores capped at ``softcap``: see the contract).

        q: [T, H, D]; k, v: [T, KVH, D]; each cache: ``KVCacheSpec.layer_shape(num_blocks)``.
        Returns [T, H, D]. Decodes are one batched SDPA call; each prefill chunk is
        one causal SDPA call (offset by its cached prefix).
        """
        if meta.num_tokens == 0:
            return torch.empty_like(q)  # [0, H, D]
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if window is not None and window >= meta.max_context_len:
            window = None  # every context fits in the window: it hides nothing
        nd = meta.num_decodes
        if window is not None or softcap is not None:
            if not (self.decodes_in_kernel and nd):
                return _masked_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
            # The decodes in the kernel, which caps and windows their scores itself; the chunks masked.
            decoded = _kernel_decode_attention(q[:nd], k_cache, v_cache, meta, scale, window=window, softcap=softcap)
            if nd == meta.num_seqs:
                return decoded
            out = _masked_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap, decodes=False)
            out[:nd] = decoded
            return out
        decode = _kernel_decode_attention if self.decodes_in_kernel else _decode_attention
        if nd == meta.num_seqs:
            return decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)  # [T, H, D]
        if nd:
            out[:nd] = decode(q[:nd], k_cache, v_cache, meta, scale)
        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = _prefill_attention(
                q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, i - nd, scale
            )
        return out

    decode_padding = staticmethod(pad_to_longest_block)


class KernelDecodeSdpaBackend(SdpaBackend):
    """:class:`SdpaBackend` whose decodes attend in asyncinfer's CPU kernel
    (:func:`asyncinfer.kernels.decode_attention`: float32 caches read in place, no gather, no mask);
    prefill chunks as SDPA runs them. Chosen at load for the block weight formats
    (:func:`asyncinfer.models.decode_backends.select_decode_backend`)."""

    name = "sdpa-kernel-decode"
    device_types = ("cpu",)
    decodes_in_kernel = True


@dataclass
class SdpaMetadata(AttentionMetadata):
    """Where this step's tokens go in the paged cache and what each one attends to.

    Sequence order is decodes first (``query_len == 1``), then prefill chunks.
    Build it with :meth:`SdpaBackend.build_metadata`; the fields after ``num_decodes`` are derived.
    """

    backend: SdpaBackend
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_lens: list[int]  # new tokens per sequence
    context_lens: list[int]  # tokens in cache per sequence after this step's write
    query_start_loc: list[int]  # [num_seqs + 1] offsets of each sequence's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    block_size: int
    num_decodes: int
    # Batched decode path (empty tensors when num_decodes == 0).
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    decode_block_tables: torch.Tensor  # [num_decodes, max_decode_blocks] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_decode_blocks * block_size] bool; None: decodes in the kernel
    decode_bias: torch.Tensor | None  # the same mask as float32 0 / -inf (SDPA's mask on a CPU in float32)
    # Prefill path, one entry per prefill sequence (index s - num_decodes):
    # None when the chunk is the whole context (plain causal attention on the new
    # k/v), else the cache slots of the whole context and the offset-causal mask.
    prefill_context_slots: list[torch.Tensor | None]  # each [context_len] int64
    prefill_masks: list[torch.Tensor | None]  # each [query_len, context_len] bool
    max_context_len: int = 0  # the longest context of the step
    # The masks of the layers with a window or soft-capped scores, per window (None: no window), made
    # by the first such layer of the step (see _step_masks).
    window_masks: dict[int | None, _StepMasks] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


def _padded_tables(block_tables: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """The block tables as one tensor, right-padded with block 0 (masked wherever it is read)."""
    width, flat = flat_padded_tables(block_tables)
    return torch.tensor(flat, dtype=torch.long, device=device).view(len(block_tables), width)  # [num_seqs, width]


def _decode_inputs(
    decode_lens: Sequence[int], block_tables: torch.Tensor, block_size: int, device: torch.device,
    masks: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Context lengths, block tables and key-padding mask (bool, and as a float 0 / -inf bias) of the
    batched decode call; no masks (None) with ``masks=False``: the kernel reads each context's own
    length (:func:`_kernel_decode_attention`).

    Every decode reads as many whole blocks as the longest one (the padding that
    :func:`pad_to_longest_block` counts); the mask keeps each to its own context.
    """
    num_decodes = len(decode_lens)
    decode_blocks = -(-max(decode_lens, default=0) // block_size)  # ceil division
    context_lens = torch.tensor(decode_lens, dtype=torch.long, device=device)  # [num_decodes]
    tables = block_tables[:num_decodes, :decode_blocks].contiguous()  # [num_decodes, decode_blocks]
    if not masks:
        return context_lens, tables, None, None
    span = decode_blocks * block_size
    positions = torch.arange(span, device=device)  # [L]
    mask = (positions[None, :] < context_lens[:, None]).view(num_decodes, 1, 1, span)  # [num_decodes, 1, 1, L]
    bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))  # [num_decodes, 1, 1, L]
    return context_lens, tables, mask, bias


def _prefill_inputs(
    query_lens: Sequence[int], context_lens: Sequence[int], block_tables: torch.Tensor, first: int, block_size: int,
    device: torch.device,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per prefill chunk (sequences ``first..``): its context's cache slots and its offset-causal mask,
    or ``(None, None)`` when the chunk is the whole context (plain causal attention on the new k/v)."""
    slots: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    for i in range(first, len(query_lens)):
        qlen, ctx = query_lens[i], context_lens[i]
        if ctx == qlen:
            slots.append(None)
            masks.append(None)
            continue
        pos = torch.arange(ctx, device=device)  # [ctx]
        slots.append(block_tables[i, pos // block_size] * block_size + pos % block_size)  # [ctx]
        # Query j sits at absolute position ctx - qlen + j and sees keys up to it.
        q_pos = torch.arange(ctx - qlen, ctx, device=device)  # [qlen]
        masks.append(pos[None, :] <= q_pos[:, None])  # [qlen, ctx]
    return slots, masks


def _validate(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    slot_mapping: Sequence[int],
    block_size: int,
) -> None:
    """Cheap consistency checks; a violation here is a bug in the caller.

    Raises:
        InvalidParameterError: naming the first inconsistent list.
    """
    if block_size <= 0:
        raise InvalidParameterError("block_size", block_size, "a positive int")
    if not (len(query_lens) == len(context_lens) == len(block_tables)):
        raise InvalidParameterError(
            "query_lens/context_lens/block_tables",
            (len(query_lens), len(context_lens), len(block_tables)),
            "lists of equal length (one entry per sequence)",
        )
    if len(slot_mapping) != sum(query_lens):
        raise InvalidParameterError("slot_mapping", len(slot_mapping), f"length sum(query_lens)={sum(query_lens)}")
    seen_prefill = False
    for i, (qlen, ctx, bt) in enumerate(zip(query_lens, context_lens, block_tables)):
        if qlen < 1 or ctx < qlen:
            raise InvalidParameterError(f"query_lens[{i}]/context_lens[{i}]", (qlen, ctx), "1 <= query_len <= context_len")
        if qlen > 1:
            seen_prefill = True
        elif seen_prefill:
            raise InvalidParameterError("query_lens", query_lens, "decodes (query_len 1) before prefills")
        if len(bt) * block_size < ctx:
            raise InvalidParameterError(f"block_tables[{i}]", len(bt), f">= {-(-ctx // block_size)} blocks for {ctx} tokens")


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys/values ([T, KVH, D]) in their cache slots, in place."""
    _, _, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # [slots, KVH, D]
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)  # [slots, KVH, D]


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: SdpaMetadata, scale: float
) -> torch.Tensor:
    """One SDPA call for all single-token sequences; q: [S, H, D] -> [S, H, D]."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    # Each decode has one query token, so the G query heads sharing a KV head can
    # ride in SDPA's query-length axis: GQA without repeating K/V, and the
    # key-padding mask is the same for all of them.
    qg = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)  # [S, KVH, G, D]
    # index_select on the flattened table, not k_cache[table]: the same copy, without advanced
    # indexing's per-call setup (aten::index cost more than the copy itself at decode sizes).
    blocks = meta.decode_block_tables.view(-1)  # [S * nb]
    keys = k_cache.index_select(0, blocks).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)  # [S, KVH, L, D]
    values = v_cache.index_select(0, blocks).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)  # [S, KVH, L, D]
    # On a CPU in float32 the float mask: SDPA would convert the bool one in every layer.
    mask = meta.decode_bias if q.device.type == "cpu" and q.dtype == torch.float32 else meta.decode_mask
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)  # [S, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)  # [S, H, D]


def _kernel_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: SdpaMetadata, scale: float,
    *, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """:func:`_decode_attention` by asyncinfer's kernel: blocks read in place, no gather, scores capped at
    ``softcap`` and each context's last ``window`` keys only when given; [S, H, D] -> [S, H, D]."""
    from asyncinfer import kernels

    return kernels.decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                    softcap=softcap, window=window)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: SdpaMetadata,
    prefill_index: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention for one prefill chunk; q: [Lq, H, D], k/v: [Lq, KVH, D] -> [Lq, H, D]."""
    slots = meta.prefill_context_slots[prefill_index]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
    if slots is None:
        # The chunk is the whole context: the new k/v are all there is.
        kh = k.transpose(0, 1).unsqueeze(0)  # [1, KVH, Lq, D]
        vh = v.transpose(0, 1).unsqueeze(0)  # [1, KVH, Lq, D]
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)  # [1, H, Lq, D]
    else:
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        kh = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
        vh = v_cache.view(-1, kv_heads, head_dim).index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
        mask = meta.prefill_masks[prefill_index]  # [Lq, ctx]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)  # [1, H, Lq, D]
    return out[0].transpose(0, 1)  # [Lq, H, D]


@dataclass(frozen=True)
class _StepMasks:
    """What a layer with a window (or soft-capped scores) lets each query see: ``decode`` [S, 1, 1, L]
    bool over the decodes' padded blocks, and per prefill chunk [query_len, context_len] bool."""

    decode: torch.Tensor | None
    prefill: list[torch.Tensor]


def _step_masks(meta: SdpaMetadata, window: int | None, decodes: bool = True) -> _StepMasks:
    """The step's masks for ``window`` (None: causal only), made once per step and window; with
    ``decodes=False`` (the decodes attend elsewhere) no decode mask is made."""
    masks = meta.window_masks.get(window)
    nd = meta.num_decodes
    if masks is not None and (masks.decode is not None or not (decodes and nd)):
        return masks
    device = meta.slot_mapping.device
    decode = None
    if nd and decodes:
        span = meta.decode_block_tables.shape[1] * meta.block_size
        pos = torch.arange(span, device=device)[None, :]  # [1, L]
        ctx = meta.decode_context_lens[:, None]  # [S, 1]; the query sits at ctx - 1
        visible = pos < ctx
        if window is not None:
            visible &= pos >= ctx - window
        decode = visible.view(nd, 1, 1, span)  # [S, 1, 1, L]
    prefill = []
    for i in range(nd, meta.num_seqs):
        qlen, ctx = meta.query_lens[i], meta.context_lens[i]
        k_pos = torch.arange(ctx, device=device)[None, :]  # [1, ctx]
        q_pos = torch.arange(ctx - qlen, ctx, device=device)[:, None]  # [qlen, 1]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        prefill.append(visible)  # [qlen, ctx]
    masks = meta.window_masks[window] = _StepMasks(decode, prefill)
    return masks


def _masked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: SdpaMetadata, scale: float, window: int | None, softcap: float | None, *, decodes: bool = True,
) -> torch.Tensor:
    """:meth:`SdpaBackend.forward` for a layer with a window or soft-capped scores (k/v already written);
    with ``decodes=False`` the prefill chunks only, the decodes' rows left for the caller to fill."""
    masks = _step_masks(meta, window, decodes)
    out = torch.empty_like(q)  # [T, H, D]
    nd = meta.num_decodes
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if nd and decodes:
        num_heads = q.shape[1]
        qg = q[:nd].reshape(nd, kv_heads, num_heads // kv_heads, head_dim)  # [S, KVH, G, D]
        blocks = meta.decode_block_tables.reshape(-1)  # [S * nb]
        keys = k_cache.index_select(0, blocks).view(nd, -1, kv_heads, head_dim).transpose(1, 2)  # [S, KVH, L, D]
        values = v_cache.index_select(0, blocks).view(nd, -1, kv_heads, head_dim).transpose(1, 2)  # [S, KVH, L, D]
        out[:nd] = _attend(qg, keys, values, masks.decode, scale, softcap).reshape(nd, num_heads, head_dim)
    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        slots = meta.prefill_context_slots[i - nd]
        if slots is None:  # the chunk is the whole context
            kh, vh = k[start:end], v[start:end]  # [ctx, KVH, D]
        else:
            kh = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots)  # [ctx, KVH, D]
            vh = v_cache.view(-1, kv_heads, head_dim).index_select(0, slots)  # [ctx, KVH, D]
        qlen, num_heads = end - start, q.shape[1]
        # The G query heads of a KV head side by side: [KVH, G, Lq, D] against [KVH, 1, ctx, D].
        qh = q[start:end].transpose(0, 1).reshape(kv_heads, num_heads // kv_heads, qlen, head_dim)
        keys, values = kh.transpose(0, 1).unsqueeze(1), vh.transpose(0, 1).unsqueeze(1)  # [KVH, 1, ctx, D]
        o = _attend(qh, keys, values, masks.prefill[i - nd], scale, softcap)  # [KVH, G, Lq, D]
        out[start:end] = o.reshape(num_heads, qlen, head_dim).transpose(0, 1)  # [Lq, H, D]
    return out


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Masked attention of q [..., Lq, D] over keys/values [..., L, D] (broadcast), mask [..., Lq, L] bool
    (True: seen); with ``softcap``, the scores capped as transformers' eager attention caps them."""
    if softcap is None:
        if keys.shape[:-2] != q.shape[:-2]:  # SDPA does not broadcast the batch dimensions
            keys = keys.expand(*q.shape[:-2], *keys.shape[-2:])
            values = values.expand(*q.shape[:-2], *values.shape[-2:])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [..., Lq, L]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)  # [..., Lq, D]
