"""One conformance suite for every scheduler: the contract holds, nothing is lost, outputs match FIFO.

Parametrized over every built-in name plus the example plugin. Two drivers:
the shipped :func:`asyncinfer.schedulers.testing.drive_random_load` (random arrivals,
aborts, tight memory; every step checked with ``check_schedule``; with ``n > 1``
samples forked as the core forks them and prefix-cache hits on a shared system
prompt), so the built-ins pass exactly the suite plugin authors run, and the real
engine on a tiny random model (greedy tokens must equal FIFO's, token for token).
Deliberately broken plugins (forked samples queued, seats miscounted, nothing
scheduled) must fail the first driver.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.cache import KVCacheManager
from asyncinfer.schedulers import FIFOScheduler, SchedulerConfig, SchedulerOutput, builtin_schedulers, create_scheduler
from asyncinfer.schedulers.testing import LIMITS, drive_random_load
from tests.helpers import CountsRequestsNotSeats, QueuesForkedSamples

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_scheduler.py"


def _example_class():
    spec = importlib.util.spec_from_file_location("custom_scheduler_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FairShareScheduler


SPECS = [*builtin_schedulers(), "example:fair-share"]


def resolve(spec: str):
    return _example_class() if spec == "example:fair-share" else spec


# Options that make each policy's special paths fire within a short run.
OPTIONS = {"length-bucket": {"max_wait": 0.5, "bucket_edges": [8, 16, 32]}, "pd-split": {"prefill_budget": 5}}

def drive(spec, seed: int, limits: tuple[int, int, int, int], *, samples: bool = False) -> dict[str, int]:
    """The shipped :func:`~asyncinfer.schedulers.testing.drive_random_load` (random arrivals and aborts,
    every step checked; ``samples``: forked samples and prefix hits); the counts of its hard paths."""
    run = drive_random_load(resolve(spec), seed, limits, OPTIONS.get(spec), samples=samples)
    return {"preempted": run.preempted, "aborted": run.aborted, "forked": run.forked, "prefix_hits": run.prefix_hits}


@pytest.mark.parametrize("spec", SPECS)
def test_contract_holds_under_random_load(spec: str) -> None:
    totals = {"preempted": 0, "aborted": 0}
    for seed in range(4):
        for limits in LIMITS:
            for key, value in drive(spec, seed, limits).items():
                totals[key] = totals.get(key, 0) + value
    assert totals["preempted"] > 0 and totals["aborted"] > 0  # the hard paths really ran


@pytest.mark.parametrize("spec", SPECS)
def test_contract_holds_with_parallel_samples_and_prefix_hits(spec: str) -> None:
    totals = {"preempted": 0, "aborted": 0, "forked": 0, "prefix_hits": 0}
    for seed in range(4):
        for limits in LIMITS:
            for key, value in drive(spec, seed, limits, samples=True).items():
                totals[key] += value
    assert all(totals.values()), totals  # every hard path really ran


class Stalls(FIFOScheduler):
    """Broken: stops scheduling anything once a request of several samples waits."""

    def schedule(self) -> SchedulerOutput:
        if any(r.params.n > 1 for r in self.waiting):
            return SchedulerOutput()
        return super().schedule()


@pytest.mark.parametrize("broken", [QueuesForkedSamples, CountsRequestsNotSeats, Stalls])
def test_a_plugin_with_a_liveness_or_seat_bug_fails_the_suite(broken) -> None:
    with pytest.raises(AssertionError):
        for seed in range(4):
            for limits in LIMITS:
                drive(broken, seed, limits, samples=True)


@pytest.mark.parametrize("spec", SPECS)
def test_flags_are_declared(spec: str) -> None:
    cls = type(create_scheduler(resolve(spec), SchedulerConfig(), KVCacheManager(8, 4), OPTIONS.get(spec)))
    assert isinstance(cls.uses_priority, bool) and isinstance(cls.starvation_free, bool)
    assert cls.uses_priority == (spec == "aging-priority")


# ---------------------------------------------------------------- real engine: token identity with FIFO

# 40 blocks of 4 tokens for 8 requests growing to ~45 tokens: preemption is certain.
ENGINE = {"kv_cache_memory": 40 * 1024, "max_model_len": 64, "dtype": "float32", "device": "cpu", "block_size": 4,
          "max_num_batched_tokens": 24, "max_num_seqs": 5}


async def run_engine(path: Path, spec: str) -> tuple[list[list[int]], int]:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 22))] for _ in range(8)]
    engine = AsyncEngine.from_pretrained(path, **ENGINE, scheduler=resolve(spec), scheduler_options=OPTIONS.get(spec))
    async with engine:

        async def one(i: int):
            await asyncio.sleep(0.004 * i)
            params = SamplingParams(max_tokens=24, ignore_eos=True)
            return await engine.generate(prompts[i], params, request_id=f"t{i % 2}/{i}", priority=(7 * i) % 4)

        outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    stats = engine.kv_stats()
    assert stats.used_blocks == 0
    # One count of preemptions, read the same from the cache, the core and the requests.
    assert stats.preemptions == engine.step_stats().preemptions == sum(o.metrics.num_preemptions for o in outs)
    return [o.token_ids for o in outs], stats.preemptions


@pytest.fixture(scope="module")
def fifo_tokens(tiny_llama: Path) -> list[list[int]]:
    tokens, preemptions = asyncio.run(run_engine(tiny_llama, "fifo"))
    assert preemptions > 0
    return tokens


@pytest.mark.parametrize("spec", [s for s in SPECS if s != "fifo"])
async def test_greedy_tokens_identical_to_fifo(spec: str, tiny_llama: Path, fifo_tokens) -> None:
    tokens, _ = await run_engine(tiny_llama, spec)
    assert tokens == fifo_tokens


async def test_preemptions_are_counted_once_with_parallel_samples(tiny_llama: Path) -> None:
    """n > 1: each sample is a request to the scheduler; the user's metrics add its samples' counts."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(6, 18))] for _ in range(6)]
    engine = AsyncEngine.from_pretrained(tiny_llama, **ENGINE)
    async with engine:
        outs = await asyncio.gather(*(
            engine.generate(p, SamplingParams(max_tokens=20, ignore_eos=True, n=1 + i % 3, seed=i))
            for i, p in enumerate(prompts)))
    preemptions = engine.kv_stats().preemptions
    assert preemptions > 0
    assert engine.step_stats().preemptions == preemptions
    assert sum(o.metrics.num_preemptions for o in outs) == preemptions
    assert [len(o.outputs) for o in outs] == [1, 2, 3, 1, 2, 3]
