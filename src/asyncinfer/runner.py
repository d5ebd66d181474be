"""ModelRunner: turns a step's plain-data schedule into tensors and runs the model.

Input: ``[(request, num_new_tokens)]`` plus each request's block table. Output:
logits for the requests that caught up with all their known tokens this step
(a decode, or the last chunk of a prefill) — the only rows worth sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from asyncinfer.cache.kv_tensors import allocate_kv_caches, copy_blocks
from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.models import AttentionBackend, ModelConfig
from asyncinfer.models.attention.padding import flat_padded_tables
from asyncinfer.request import Request


@dataclass
class StepInputs:
    """The flattened, unpadded token batch of one step (Python lists; tensors are built once)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]  # flat index of the last token of every sampled request
    sampled: list[Request]  # requests whose row is in the logits, in row order
    order: list[Request]  # requests in batch order (decodes first)


class ModelRunner:
    """Owns the model weights and the preallocated paged KV tensors (laid out by ``spec``).

    ``backend`` builds each step's attention metadata; the model's attention layers
    run through it (the metadata carries it).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        spec: KVCacheSpec,
        *,
        num_blocks: int,
        backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.config = config
        self.spec = spec
        self.backend = backend
        self.kv_caches = allocate_kv_caches(spec, num_blocks)
        self.compile_seconds: float | None = None  # set when the model's chains were compiled (torch_compile)
        #: After :meth:`execute`: each logits row's argmax when the step's kernel computed it (the greedy
        #: tokens, for the sampler), else None.
        self.greedy_tokens: list[int] | None = None

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def device(self) -> torch.device:
        return self.spec.device

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-write, before the forward)."""
        copy_blocks(self.kv_caches, pairs)

    def prepare(self, batch: Sequence[tuple[Request, int]], block_tables: dict[str, list[int]]) -> StepInputs:
        """Flatten the step's tokens; decodes first (one batched attention call covers them)."""
        order = sorted(batch, key=lambda item: item[1] != 1)  # stable: decodes, then prefills
        bs = self.block_size
        inputs = StepInputs([], [], [], [], [], [], [], [], [])
        for request, n in order:
            start = request.num_computed_tokens
            end = start + n
            table = block_tables[request.request_id]
            all_ids = request.all_token_ids if n > 1 else None
            inputs.input_ids.extend(all_ids[start:end] if all_ids is not None else [request.token_at(start)])
            inputs.positions.extend(range(start, end))
            inputs.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            inputs.query_lens.append(n)
            inputs.context_lens.append(end)
            inputs.block_tables.append(table)
            inputs.order.append(request)
            if end == request.num_tokens:
                inputs.logits_indices.append(len(inputs.input_ids) - 1)
                inputs.sampled.append(request)
        return inputs

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run one forward pass; returns float32 logits ``[len(inputs.sampled), vocab]``."""
        device = self.device
        num_tokens = len(inputs.input_ids)
        self.greedy_tokens = None
        decodes_only = num_tokens == len(inputs.query_lens) == len(inputs.logits_indices)  # each one sampled
        if num_tokens and decodes_only and getattr(self.backend, "native_decode", False):  # one kernel call
            done = self._decode_packed(inputs, num_tokens)
            if done is not None:
                logits, self.greedy_tokens = done
                return logits  # [num_tokens, vocab]
        input_ids, positions = torch.tensor([inputs.input_ids, inputs.positions], dtype=torch.long,
                                            device=device).unbind()  # [num_tokens] each: one copy from Python
        meta = self.backend.build_metadata(
            query_lens=inputs.query_lens,
            context_lens=inputs.context_lens,
            block_tables=inputs.block_tables,
            slot_mapping=inputs.slot_mapping,
            block_size=self.block_size,
            device=device,
        )
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
            if not inputs.logits_indices:
                return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
            index = torch.tensor(inputs.logits_indices, dtype=torch.long, device=device)
            return self.model.compute_logits(hidden.index_select(0, index)).float()  # [num_sampled, vocab]

    def _decode_packed(self, inputs: StepInputs, num_tokens: int) -> tuple[torch.Tensor, list[int]] | None:
        """A step of decodes through the model's ``decode_packed`` (asyncinfer's kernels): its integers in
        one list (ids, positions, slots, context lengths, block tables padded to the widest), none of the
        per-step tensors and metadata the general path builds (each torch op costs tens of microseconds
        on a cache that the step's weights have just swept). None where the model has no such path."""
        fast = getattr(self.model, "decode_packed", None)
        if fast is None:
            return None
        width, tables = flat_padded_tables(inputs.block_tables)
        packed = inputs.input_ids + inputs.positions + inputs.slot_mapping + inputs.context_lens + tables
        return fast(packed, num_tokens, width, self.kv_caches)
