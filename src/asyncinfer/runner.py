"""ModelRunner: turns a step's plain-data schedule into the model's inputs and runs it.

Input: ``[(request, num_new_tokens)]`` plus each request's block table. Output: one
:class:`~asyncinfer.models.decode_backends.ModelOutput`: the logits of the requests that caught up
with all their known tokens this step (a decode, or the last chunk of a prefill) — the only rows
worth sampling — and, when the step computed them, each row's greedy token. How the model runs is
the decode backend's (:mod:`asyncinfer.models.decode_backends`), chosen once at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from asyncinfer.cache.kv_tensors import allocate_kv_caches, copy_blocks
from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.errors import InvalidParameterError
from asyncinfer.models import ModelConfig
from asyncinfer.models.decode_backends import DecodeBackend, ModelOutput, StepBatch
from asyncinfer.models.layers import RopeRows
from asyncinfer.request import Request

__all__ = ["ModelOutput", "ModelRunner", "StepInputs"]


@dataclass
class StepInputs(StepBatch):
    """The step's flattened batch (:class:`StepBatch`) and the requests it belongs to."""

    sampled: list[Request]  # requests whose row is in the logits, in row order
    order: list[Request]  # requests in batch order (decodes first)


class ModelRunner:
    """Owns the model weights, the preallocated paged KV tensors (laid out by ``spec``) and the one
    decode backend the model runs through (``decode``, chosen at load: its ``attention`` builds each
    step's metadata). ``rope_rows``: which rope-table row each token reads (its position, except a longrope
    model's long requests below the original context), fixed by the config."""

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        spec: KVCacheSpec,
        *,
        num_blocks: int,
        decode: DecodeBackend,
        compile_seconds: float | None = None,
    ) -> None:
        if decode.model is not model:
            raise InvalidParameterError("decode", type(decode).__name__, "a decode backend built for this runner's model")
        self.model = model
        self.config = config
        self.spec = spec
        self.decode = decode
        self.rope_rows = RopeRows.of(config)
        self.kv_caches = allocate_kv_caches(spec, num_blocks)
        self.compile_seconds = compile_seconds  # the load's compile time of the model's chains (torch_compile)

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
        rope_rows = self.rope_rows
        inputs = StepInputs([], [], [], [], [], [], [], [], [])
        for request, n in order:
            start = request.num_computed_tokens
            end = start + n
            table = block_tables[request.request_id]
            all_ids = request.all_token_ids if n > 1 else None
            inputs.input_ids.extend(all_ids[start:end] if all_ids is not None else [request.token_at(start)])
            rope_rows.extend(inputs.positions, request.num_tokens, start, end)
            inputs.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            inputs.query_lens.append(n)
            inputs.context_lens.append(end)
            inputs.block_tables.append(table)
            inputs.order.append(request)
            if end == request.num_tokens:
                inputs.logits_indices.append(len(inputs.input_ids) - 1)
                inputs.sampled.append(request)
        return inputs

    def run(self, inputs: StepInputs) -> ModelOutput:
        """Run one step through the decode backend: float32 logits ``[len(inputs.sampled), vocab]`` and,
        when the step computed them, each row's greedy token."""
        return self.decode.forward(inputs, self.kv_caches)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """The logits of :meth:`run` alone, for callers that time the forward without sampling
        (``lab/calibrate.py``)."""
        return self.run(inputs).logits
