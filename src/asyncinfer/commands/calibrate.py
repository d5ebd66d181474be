"""``asyncinfer lab --calibrate``: fit the lab's step-cost model to the real model runner on this machine.

    asyncinfer lab --calibrate cost.json [--model PATH]

times ``runner.prepare`` + ``runner.execute`` + the sampler on a grid of batch
shapes (:func:`asyncinfer.lab.calibrate.default_cases`: decodes at several batch sizes
and contexts, prompt chunks, mixes) and fits :class:`~asyncinfer.lab.cost.StepCostModel`
to the fastest of a few rounds of each (the least disturbed by other processes). KV
contents do not change the cost, so every sequence of a shape shares one block
table: the grid needs blocks for one ``max_model_len`` request only.

It builds an engine, so it lives here, above the engine; the lab only reads the fitted model.
"""

from __future__ import annotations

import datetime
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from asyncinfer.cache.kv_manager import blocks_for
from asyncinfer.engine import AsyncEngine
from asyncinfer.lab.calibrate import Case, cpu_name, default_cases
from asyncinfer.lab.cost import StepCostModel, StepShape, fit_cost_model
from asyncinfer.request import Request
from asyncinfer.sampler import SamplingState
from asyncinfer.sampling_params import SamplingParams

__all__ = ["calibrate", "default_cases", "time_cases"]


def time_cases(runner: Any, sampler: Any, cases: Sequence[Case], *, repeats: int = 3,
               seed: int = 0) -> list[tuple[StepShape, float]]:
    """Fastest of ``repeats`` timings of ``prepare + execute + sample`` for each case.

    The repeats go round the whole grid (after one untimed round), so a burst of
    load from another process spoils one timing of several shapes rather than
    every timing of one; the minimum is the step's own cost without that noise.
    """
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
        "cpu": cpu_name(),
        "date": datetime.date.today().isoformat(),
        "command": command,
    }
    fitted = fit_cost_model([s for s, _ in timed], [t for _, t in timed], meta)
    samples = [{**s.__dict__, "seconds": round(t, 5), "predicted": round(fitted.cost(s), 5)} for s, t in timed]
    return StepCostModel(fitted.coefficients, {**fitted.meta, "samples": samples})


