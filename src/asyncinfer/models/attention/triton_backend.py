"""The "triton" attention backend: the SDPA backend with its decodes in a Triton paged-attention kernel.

A step's decodes (one query token each, decodes first in the batch) attend in
:func:`~asyncinfer.models.attention.triton_decode.paged_decode_attention`, which reads K/V from the cache's
blocks through the block tables in place: no gather, no padding to the longest context, no mask tensors,
every context length in one launch, GQA, sliding windows and soft-capped scores. Prefill chunks (and the
prefill part of a mixed step) run as :class:`~asyncinfer.models.attention.sdpa.SdpaBackend` runs them;
the K/V write is the same ``index_copy_``.

It is the CUDA default when Triton imports (``select_attention_backend("cuda")``,
:mod:`asyncinfer.models.attention.base`); it never runs on the CPU path unless named (it runs on CPU
tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the tests check it without a
GPU). The metadata is the SDPA backend's, built without decode masks, plus the decodes' block ids and
context lengths as plain ints (:class:`~asyncinfer.models.attention.triton_decode.DecodeBounds`, from the
step's lists), so that every layer checks the kernel's indices against its cache without reading the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from asyncinfer.models.attention.sdpa import (
    SdpaBackend,
    SdpaMetadata,
    _masked_forward,
    _prefill_attention,
    write_kv,
)
from asyncinfer.models.attention.triton_decode import DecodeBounds, check_decode_inputs, launch_paged_decode

KVCache = tuple[torch.Tensor, torch.Tensor]

__all__ = ["TritonDecodeBackend", "TritonMetadata"]

_NO_DECODES = DecodeBounds(0, -1, 1, 0)


class TritonDecodeBackend(SdpaBackend):
    """:class:`SdpaBackend` whose decodes attend in the Triton paged-decode kernel (K/V blocks read in
    place; windows and soft-capped scores in the kernel); prefill chunks as SDPA runs them."""

    name = "triton"
    device_types = ("cuda",)
    decodes_in_kernel = True  # no decode masks in the metadata: the kernel reads each context's own length

    def build_metadata(
        self,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        block_size: int,
        device: torch.device | str,
    ) -> TritonMetadata:
        """The SDPA backend's metadata (validated as it validates) and the decodes' :class:`DecodeBounds`.

        Raises:
            InvalidParameterError: inconsistent lists (see :meth:`AttentionBackend.build_metadata`).
        """
        meta = super().build_metadata(query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
                                      slot_mapping=slot_mapping, block_size=block_size, device=device)
        nd = meta.num_decodes
        bounds = DecodeBounds.from_lists(block_tables[:nd], context_lens[:nd], block_size) if nd else _NO_DECODES
        return TritonMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)}, decode_bounds=bounds)

    def forward(  # type: ignore[override]  # takes the metadata this backend builds
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: TritonMetadata,
        scale: float, *, window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache, then attend (the contract's :meth:`AttentionBackend.forward`): the decodes
        in one kernel launch over the blocks in place, each prefill chunk in SDPA. q: [T, H, D] -> [T, H, D].

        Raises:
            InvalidParameterError: the cache does not match the queries (dtype, heads, head size) or does
                not hold a block the step's tables name, before the kernel launches.
        """
        if meta.num_tokens == 0:
            return torch.empty_like(q)  # [0, H, D]
        k_cache, v_cache = kv_cache
        if window is not None and window >= meta.max_context_len:
            window = None  # every context fits in the window: it hides nothing
        nd = meta.num_decodes
        if nd:  # before anything is written: the cache, the queries and the tables' ids agree
            check_decode_inputs(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                window, softcap, meta.decode_bounds)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if nd == meta.num_seqs:
            return self._decodes(q, k_cache, v_cache, meta, scale, window, softcap)
        if window is not None or softcap is not None:
            out = _masked_forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap, decodes=False)
        else:
            out = torch.empty_like(q)  # [T, H, D]
            for i in range(nd, meta.num_seqs):
                start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
                out[start:end] = _prefill_attention(
                    q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, i - nd, scale
                )
        if nd:
            out[:nd] = self._decodes(q[:nd], k_cache, v_cache, meta, scale, window, softcap)
        return out

    @staticmethod
    def _decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonMetadata, scale: float,
                 window: int | None, softcap: float | None) -> torch.Tensor:
        """The decodes' rows, [num_decodes, H, D], in one launch of the kernel (its inputs checked by ``forward``)."""
        return launch_paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                   window, softcap)

    @staticmethod
    def decode_padding(context_lens: Sequence[int], block_size: int) -> int:
        """0: each decode reads its own context's blocks in place, nothing beyond."""
        return 0


@dataclass
class TritonMetadata(SdpaMetadata):
    """:class:`SdpaMetadata` (without decode masks) and the decodes' block ids and context lengths as ints."""

    backend: TritonDecodeBackend  # type: ignore[assignment]  # the backend that built it
    decode_bounds: DecodeBounds = _NO_DECODES
