"""The scheduler conformance suite, whole: the rules and the real engine's check, for your class.

In any project, with plain pytest (or no test runner at all)::

    from asyncinfer.conformance import check_scheduler
    from mypkg.policies import ShortestFirst

    def test_shortest_first_conforms():
        report = check_scheduler(ShortestFirst, options={"max_wait": 2.0})
        assert report.preempted > 0  # optional: the tight-memory paths really ran

:func:`check_scheduler` runs :func:`asyncinfer.schedulers.testing.check_rules` (flags,
random load, starvation; no model) and then :func:`check_matches_fifo`: the real engine
on a tiny random model (:func:`tiny_model`), greedy outputs token-identical to FIFO's
under preemption. A scheduler changes the order work is done in, never the tokens.

This module drives the engine, so it sits above it (as the CLI does); the rules it
re-exports live in :mod:`asyncinfer.schedulers.testing`, which imports neither torch
nor the engine. A failure raises :class:`ContractViolation` (an ``AssertionError``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from asyncinfer.engine import AsyncEngine
from asyncinfer.models.loader import build_targets, read_model_config
from asyncinfer.models.meta import build_on_meta
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers.testing import (
    LIMITS,
    ConformanceReport,
    ContractViolation,
    LoadReport,
    SchedulerSpec,
    check_flags,
    check_no_starvation,
    check_rules,
    check_schedule,
    drive_random_load,
)

__all__ = [
    "ENGINE_OPTIONS",
    "LIMITS",
    "ConformanceReport",
    "ContractViolation",
    "LoadReport",
    "check_flags",
    "check_matches_fifo",
    "check_no_starvation",
    "check_rules",
    "check_schedule",
    "check_scheduler",
    "drive_random_load",
    "engine_tokens",
    "tiny_model",
]

#: 40 blocks of 4 tokens for 8 requests growing to ~45 tokens: preemption is certain.
ENGINE_OPTIONS: dict[str, Any] = {"kv_cache_memory": 40 * 1024, "max_model_len": 64, "dtype": "float32",
                                  "device": "cpu", "block_size": 4, "max_num_batched_tokens": 24, "max_num_seqs": 5}

# A tiny Llama: 2 layers, 4 heads (2 KV heads) of 16 dims, a 320-token vocabulary.
_TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "bos_token_id": 1, "eos_token_id": 2, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """Write (once) a tiny random Llama checkpoint into ``directory`` (config.json + safetensors).

    Weights are drawn wide (N(0, 0.1); norms around 1) so that logits are well
    separated and greedy decoding does not flip on float noise between batch shapes.
    """
    path = Path(directory)
    if (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_TINY))
    config = read_model_config(path)
    shapes = dict(build_on_meta(config).named_parameters())
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, target in sorted(build_targets(config, "hf").items()):
        shape = shapes[target.param].shape
        if target.rows is not None:
            shape = (target.rows.stop - target.rows.start, *shape[1:])
        weight = torch.randn(shape, generator=generator) * 0.1
        tensors[name] = (1 + weight) if name.endswith("norm.weight") else weight
    save_file(tensors, str(path / "model.safetensors"))
    return path


def engine_tokens(model: str | Path, scheduler: SchedulerSpec, options: Mapping[str, Any] | None = None,
                  *, engine_options: Mapping[str, Any] | None = None) -> tuple[list[list[int]], int]:
    """Greedy outputs of 8 staggered requests (two tenants, priorities 0-3) under ``scheduler``,
    and the preemptions the engine counted. Runs its own event loop (in a thread if one runs here)."""

    async def run() -> tuple[list[list[int]], int]:
        rng = random.Random(11)
        prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 22))] for _ in range(8)]
        engine = await AsyncEngine.load(model, **{**ENGINE_OPTIONS, **(engine_options or {})},
                                        scheduler=scheduler, scheduler_options=dict(options or {}))
        async with engine:

            async def one(i: int) -> list[int]:
                await asyncio.sleep(0.004 * i)
                params = SamplingParams(max_tokens=24, ignore_eos=True)
                out = await engine.generate(prompts[i], params, request_id=f"t{i % 2}/{i}", priority=(7 * i) % 4)
                return out.token_ids

            tokens = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        stats = engine.kv_stats()
        if stats.used_blocks != 0 or stats.preemptions != engine.step_stats().preemptions:
            raise ContractViolation(f"{scheduler}: {stats.used_blocks} blocks still used after the run, or the "
                                    "cache and the core count preemptions differently")
        return list(tokens), stats.preemptions

    return _run(run())


def check_matches_fifo(scheduler: SchedulerSpec, options: Mapping[str, Any] | None = None,
                       *, model: str | Path | None = None, fifo: list[list[int]] | None = None) -> int:
    """The real engine's greedy outputs under ``scheduler`` equal FIFO's, token for token; returns
    its preemption count. ``model``: a checkpoint (default: :func:`tiny_model` in a temporary
    directory); ``fifo``: FIFO's outputs, if already computed (:func:`engine_tokens`)."""
    with tempfile.TemporaryDirectory(prefix="asyncinfer-conformance-") as tmp:
        model = model if model is not None else tiny_model(tmp)
        expected = fifo if fifo is not None else engine_tokens(model, "fifo")[0]
        tokens, preemptions = engine_tokens(model, scheduler, options)
    for i, (got, want) in enumerate(zip(tokens, expected)):
        if got != want:
            raise ContractViolation(f"{scheduler}: request {i}'s greedy tokens differ from FIFO's: {got} != {want}")
    return preemptions


# --------------------------------------------------------------------------- all of it


def check_scheduler(
    scheduler: SchedulerSpec,
    options: Mapping[str, Any] | None = None,
    *,
    seeds: Iterable[int] = range(4),
    limits: Iterable[tuple[int, int, int, int]] = LIMITS,
    engine: bool = True,
    model: str | Path | None = None,
) -> ConformanceReport:
    """Run the whole suite on ``scheduler``: flags, :func:`drive_random_load` for every seed and
    limit (with and without parallel samples and prefix hits), :func:`check_no_starvation`, and
    (``engine=True``) :func:`check_matches_fifo` on a tiny model (about 10 s on 2 cores).

    Raises:
        ContractViolation: the first check that failed, with what, where and when.
        InvalidParameterError: ``scheduler`` or ``options`` cannot be constructed.
    """
    report = check_rules(scheduler, options, seeds=seeds, limits=limits)
    if not engine:
        return report
    return dataclasses.replace(report, engine_preemptions=check_matches_fifo(scheduler, options, model=model))


def _run(coro: Any) -> Any:
    """``asyncio.run(coro)``, in a fresh thread when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="asyncinfer-conformance")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
