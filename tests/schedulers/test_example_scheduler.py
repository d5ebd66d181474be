"""examples/custom_scheduler.py: a third-party policy through the registry, with its defining property."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.cache import KVCacheManager
from asyncinfer.lab import TraceRequest, simulate
from asyncinfer.request import Request
from asyncinfer.schedulers import SchedulerConfig, available_schedulers, resolve_scheduler
from tests.helpers import greedy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_scheduler.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_scheduler_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers "fair-share"
    return module


def test_registered_by_name(example) -> None:
    assert "fair-share" in available_schedulers()
    assert resolve_scheduler("fair-share") is example.FairShareScheduler


def flood_and_one(name: str):
    """Tenant "bulk" sends 40 requests at t=0; tenant "solo" sends one a moment later."""
    trace = [TraceRequest(f"bulk/{i}", 0.0, 64, 64) for i in range(40)]
    trace.append(TraceRequest("solo/0", 0.01, 64, 64))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
    result = simulate(trace, name, config=config, num_blocks=512)
    return {r.id: r for r in result.records}


def test_a_flooding_tenant_does_not_starve_another(example) -> None:
    fair, fifo = flood_and_one("fair-share"), flood_and_one("fifo")
    assert fair["solo/0"].wait < 0.2 * fifo["solo/0"].wait  # FIFO puts it behind all 40
    # Four slots, all taken at t=0 by "bulk": "solo" starts as soon as one frees.
    first_free = min(r.first_scheduled for r in fair.values() if r.first_scheduled > 0)
    assert fair["solo/0"].first_scheduled == first_free


def test_weights_share_tokens(example) -> None:
    sched = example.FairShareScheduler(SchedulerConfig(), KVCacheManager(8, 4), weights={"a": 2.0})
    sched.usage.update({"a": 100.0, "b": 60.0})
    a, b = (Request(f"{t}/1", [1], SamplingParams(), arrival_time=0.0) for t in "ab")
    assert sched.share(a) < sched.share(b)  # a used 100 with weight 2: 50 per unit, below b's 60


async def test_runs_in_the_engine_by_name(example, tiny_llama: Path) -> None:
    """Two tenants' requests, two seats: greedy tokens are the same whatever the policy's order."""
    prompts = {f"{tenant}/{i}": [5 + i, 6, 7 + 3 * i, 8] for tenant in ("a", "b") for i in range(3)}

    async def tokens(scheduler: str) -> dict[str, list[int]]:
        engine = AsyncEngine.from_pretrained(tiny_llama, kv_cache_memory=1 << 20, max_model_len=64, device="cpu",
                                             dtype="float32", max_num_seqs=2, scheduler=scheduler)
        async with engine:
            outs = await asyncio.gather(*(engine.generate(p, greedy(6), request_id=rid) for rid, p in prompts.items()))
        assert type(engine.core.scheduler) is resolve_scheduler(scheduler)
        return {rid: out.token_ids for rid, out in zip(prompts, outs)}

    assert resolve_scheduler("fair-share") is example.FairShareScheduler
    fair, fifo = await tokens("fair-share"), await tokens("fifo")
    assert fair == fifo and all(len(t) == 6 for t in fair.values())
