"""Measuring what a weight format costs in quality: the engine's own model against a float32 copy.

Two measures, used by ``benchmarks/quality.py`` and by the quality gates in the tests:

- teacher-forced top-1 agreement: over a fixed text, the fraction of positions where the
  format's most likely next token is the float32 model's (both read the same tokens);
- greedy common prefix: from the same prompts, how many generated tokens stay identical.

Both drive the model directly over a paged KV cache, as the engine's runner does, without
the engine: a copy of one loaded model can be put in every format (:func:`formatted`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from asyncinfer.models.decode_backends import StepBatch, select_decode_backend
from asyncinfer.models.quant import apply_weight_format


def formatted(model: nn.Module, method: str | None, skip: Iterable[str] = (), *, pack: bool = False,
              activation_dtype: str = "int16") -> nn.Module:
    """A copy of float32 ``model`` with its projections in ``method``'s format (``model`` is left as it is); a block
    format's layers round a step's activations as ``activation_dtype`` says."""
    out = copy.deepcopy(model)
    apply_weight_format(out, method, skip, pack=pack, activation_dtype=activation_dtype)
    return out


class _Cache:
    """A paged KV cache for a few sequences, blocks handed out in order, as the runner's metadata wants it."""

    def __init__(self, model: nn.Module, total_tokens: int, block_size: int = 16) -> None:
        cfg = model.config
        self.block_size = block_size
        num_blocks = -(-total_tokens // block_size) + 64
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        self.next_block = 0
        self.tables: list[list[int]] = []
        self.lens: list[int] = []
        # The model runs as the engine runs it: the decode backend the load would choose for it (a block
        # format's steps of decodes in one kernel call, its decode attention in the kernel too).
        self.decode = select_decode_backend(model, cfg, torch.device("cpu"))

    def run(self, work: Sequence[tuple[int, Sequence[int]]], rows: str) -> torch.Tensor:
        """One forward over ``(sequence, new tokens)`` pairs (a new sequence gets the next index).

        ``rows``: "all" (logits of every new token) or "last" (of each sequence's last one).
        """
        ids, positions, slots, query_lens = [], [], [], []
        for seq, tokens in work:
            if seq == len(self.tables):
                self.tables.append([])
                self.lens.append(0)
            table, start = self.tables[seq], self.lens[seq]
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size == len(table):
                    table.append(self.next_block)
                    self.next_block += 1
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids.extend(tokens)
            self.lens[seq] = start + len(tokens)
            query_lens.append(len(tokens))
        seqs = [seq for seq, _ in work]
        ends = list(itertools.accumulate(query_lens))
        rows_index = list(range(len(ids))) if rows == "all" else [end - 1 for end in ends]
        step = StepBatch(ids, positions, slots, query_lens, [self.lens[s] for s in seqs],
                         [self.tables[s] for s in seqs], rows_index)
        return self.decode.forward(step, self.layers).logits  # [T or S, vocab]


def teacher_forced_argmax(model: nn.Module, ids: Sequence[int], chunk: int = 256) -> torch.Tensor:
    """The most likely next token at every position of ``ids`` [n], read in prefill chunks of ``chunk`` tokens
    (the engine's chunked prefill: int8 quantizes each chunk's activations per tensor)."""
    cache = _Cache(model, len(ids))
    out = []
    for start in range(0, len(ids), chunk):
        out.append(cache.run([(0, ids[start:start + chunk])], "all").argmax(-1))
    return torch.cat(out)  # [n]


def top1_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Fraction of positions where two :func:`teacher_forced_argmax` results agree."""
    return float((reference == other).float().mean())


def batched_greedy(model: nn.Module, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """``max_tokens`` greedy tokens for each prompt: the prompts prefilled one by one, then decoded together
    (one decode step for all of them per token, as the engine batches them)."""
    cache = _Cache(model, sum(len(p) for p in prompts) + len(prompts) * max_tokens)
    outs = [[int(cache.run([(i, list(p))], "last")[0].argmax())] for i, p in enumerate(prompts)]
    while len(outs[0]) < max_tokens:
        logits = cache.run([(i, out[-1:]) for i, out in enumerate(outs)], "last")  # [S, vocab]
        for out, token in zip(outs, logits.argmax(-1).tolist()):
            out.append(token)
    return outs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_match(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> tuple[float, float]:
    """``(fraction of prompts identical over every token, mean common-prefix fraction)``."""
    prefixes = [common_prefix(r, o) / len(r) for r, o in zip(reference, other)]
    return sum(p == 1.0 for p in prefixes) / len(prefixes), sum(prefixes) / len(prefixes)
