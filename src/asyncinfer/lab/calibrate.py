"""Fit the lab's step-cost model to the real model runner on this machine.

    asyncinfer lab --calibrate cost.json [--model PATH]

times ``runner.prepare`` + ``runner.execute`` + the sampler on a grid of batch
shapes (decodes at several batch sizes and contexts, prompt chunks, mixes) and
fits :class:`~asyncinfer.lab.cost.StepCostModel` to the fastest of a few
rounds of each (the least disturbed by other processes). KV
contents do not change the cost, so every sequence of a shape shares one block
table: the grid needs blocks for one ``max_model_len`` request only.
"""

from __future__ import annotations

import datetime
import platform
import random
import time
from collections.abc import Sequence
from typing import Any

from asyncinfer.cache.kv_manager import blocks_for
from asyncinfer.lab.cost import StepCostModel, StepShape, fit_cost_model

#: A step to time: ``(num_computed_tokens, num_new_tokens, num_tokens)`` per request.
Case = list[tuple[int, int, int]]


def _decodes(batch: int, context: int) -> Case:
    return [(context - 1, 1, context)] * batch


def _chunk(query: int, prior: int = 0, last: bool = True) -> Case:
    return [(prior, query, prior + query + (0 if last else 1))]


def default_cases(max_context: int = 2048) -> list[Case]:
    """Decode batches of 1-64 at short and long contexts, prompt chunks of 16-512 tokens, mixes."""
    long = min(max_context, 2000)
    cases: list[Case] = []
    for batch in (1, 4, 16, 32, 64):
        for context in (128, min(1024, long)):
            cases.append(_decodes(batch, context))
    cases.append(_decodes(8, long))
    cases += [_chunk(q) for q in (16, 64, 256, 512)]
    cases += [_chunk(256, prior=min(512, long - 256), last=False), _chunk(128, prior=long - 128)]
    cases += [_chunk(32) * 4, _chunk(16) * 8]
    cases += [_decodes(16, 512) + _chunk(128), _decodes(32, 256) + _chunk(256, last=False)]
    return cases


def time_cases(runner: Any, sampler: Any, cases: Sequence[Case], *, repeats: int = 3,
               seed: int = 0) -> list[tuple[StepShape, float]]:
    """Fastest of ``repeats`` timings of ``prepare + execute + sample`` for each case.

    The repeats go round the whole grid (after one untimed round), so a burst of
    load from another process spoils one timing of several shapes rather than
    every timing of one; the minimum is the step's own cost without that noise.
    """
    from asyncinfer.request import Request
    from asyncinfer.sampler import SamplingState
    from asyncinfer.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = runner.config.vocab_size
    bs = runner.block_size
    longest = max(known for case in cases for _, _, known in case)
    table = list(range(blocks_for(longest, bs)))
    params = SamplingParams()
    batches = []
    for case in cases:
        batch = []
        for i, (computed, n, known) in enumerate(case):
            request = Request(f"c{i}", [rng.randrange(vocab) for _ in range(known)], params, arrival_time=0.0)
            request.num_computed_tokens = computed
            batch.append((request, n))
        batches.append(batch)
    best = [float("inf")] * len(cases)
    for rep in range(repeats + 1):
        for i, batch in enumerate(batches):
            tables = {r.request_id: table for r, _ in batch}
            t0 = time.perf_counter()
            inputs = runner.prepare(batch, tables)
            logits = runner.execute(inputs)
            sampler(logits, [SamplingState(params=params, prompt_token_ids=r.prompt_token_ids) for r in inputs.sampled])
            if rep:
                best[i] = min(best[i], time.perf_counter() - t0)
    shapes = [StepShape.from_batch(((r.num_computed_tokens, n, r.num_tokens) for r, n in b), bs) for b in batches]
    return list(zip(shapes, best))


def calibrate(model: str | None = None, *, repeats: int = 3, command: str = "", **engine_options: Any
              ) -> StepCostModel:
    """Build an engine for ``model`` (default model if ``None``), time its runner, fit the cost model."""
    import torch

    from asyncinfer.engine import AsyncEngine

    options: dict[str, Any] = {"device": "cpu", "max_model_len": 2048, "kv_cache_memory": 160 * 2**20}
    options.update(engine_options)
    engine = AsyncEngine.from_pretrained(model, **options)
    core = engine.core
    cases = default_cases(engine.max_model_len)
    timed = time_cases(core.runner, core.sampler, cases, repeats=repeats)
    meta = {
        "model": str(engine.model_source).rsplit("/", 1)[-1],
        "device": str(engine.config.device),
        "dtype": str(engine.config.dtype).removeprefix("torch."),
        "block_size": engine.config.block_size,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "date": datetime.date.today().isoformat(),
        "command": command,
    }
    fitted = fit_cost_model([s for s, _ in timed], [t for _, t in timed], meta)
    samples = [{**s.__dict__, "seconds": round(t, 5), "predicted": round(fitted.cost(s), 5)} for s, t in timed]
    return StepCostModel(fitted.coefficients, {**fitted.meta, "samples": samples})


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
