"""One conformance suite for every scheduler: the contract holds, nothing is lost, outputs match FIFO.

Parametrized over every built-in name plus the example plugin. Two drivers:
a pure-Python one (random arrivals, aborts, tight memory; every step checked
with :func:`asyncinfer.lab.check_schedule`; with ``n > 1`` samples forked as the
core forks them and prefix-cache hits on a shared system prompt), and the real
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
from asyncinfer.lab import check_schedule
from asyncinfer.request import Request, RequestStatus
from asyncinfer.schedulers import FIFOScheduler, SchedulerConfig, SchedulerOutput, builtin_schedulers, create_scheduler
from asyncinfer.step import apply_step, fork_samples

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

LIMITS = [
    # (num_blocks, block_size, max_num_seqs, max_num_batched_tokens): roomy, tight memory, tiny budget
    (256, 4, 8, 64),
    (26, 4, 6, 48),
    (40, 2, 3, 7),
]


def drive(spec, seed: int, limits: tuple[int, int, int, int], *, samples: bool = False) -> dict[str, int]:
    """Random arrivals and aborts through ``schedule``; returns the preemption, abort, fork and hit counts.

    ``samples``: requests of up to 3 samples, forked as the core forks them, and prompts
    that mostly start with one shared system prompt, with prefix caching on.
    """
    num_blocks, block_size, max_seqs, budget = limits
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, watermark=0.05, enable_prefix_caching=samples)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=48)
    sched = create_scheduler(resolve(spec), config, kv, OPTIONS.get(spec))
    now = [0.0]
    sched.clock = lambda: now[0]
    arrivals = sorted((rng.randrange(60), i) for i in range(30))
    system = [rng.randrange(3, 300) for _ in range(12)]
    created: list[Request] = []
    ended: dict[str, str] = {}
    counts = {"preempted": 0, "aborted": 0, "forked": 0}

    def sample(caught_up: list[Request]) -> list[tuple[Request, int]]:
        pairs = []
        for request in caught_up:
            pairs.append((request, 5))
            for child in fork_samples(kv, request):  # as the core: samples share the prompt's blocks
                created.append(child)
                pairs.append((child, 5))
                counts["forked"] += 1
        return pairs

    step = 0
    while arrivals or sched.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            size = rng.randrange(1, 30)
            if samples and rng.random() < 0.7:
                prompt = [*system, *(rng.randrange(3, 300) for _ in range(size))][:size]
            else:
                prompt = [1] * size
            n = rng.choice([1, 1, 2, 3]) if samples else 1
            params = SamplingParams(max_tokens=rng.randrange(1, 48 - len(prompt) + 1), ignore_eos=True, n=n)
            tenant = rng.choice("ab")
            created.append(Request(f"{tenant}/{i}", prompt, params, arrival_time=now[0], priority=rng.randrange(4)))
            sched.add_request(created[-1])
        if sched.requests and rng.random() < 0.04:
            victim = rng.choice(sorted(sched.requests))
            assert sched.abort_request(victim).status is RequestStatus.FINISHED_ABORTED
            ended[victim] = "abort"
            counts["aborted"] += 1
        step += 1
        now[0] += 0.05
        if not sched.has_unfinished_requests():
            continue
        plan = sched.schedule()
        kv.commit_step()
        check_schedule(sched, plan, f"{spec} seed {seed} step {step}")
        counts["preempted"] += len(plan.preempted)
        for request in apply_step(sched, plan, sample).finished:
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.num_output_tokens == request.params.max_tokens
            ended[request.request_id] = "length"
        # Forked samples joined the running set within max_num_seqs, and no waiting request holds blocks.
        assert sched.num_running <= max_seqs, f"{spec} seed {seed} step {step}: running past max_num_seqs"
        assert not [r.request_id for r in sched.waiting if kv.block_table(r.request_id)], "a queued request holds blocks"
        assert step < 20_000, "no end in sight"
    assert len(ended) == len(created) == 30 + counts["forked"], "a request was lost"
    assert kv.num_free_blocks == num_blocks and not sched.requests
    # Every preemption the plans listed is counted once by the cache and once on its request.
    assert kv.num_preemptions == counts["preempted"] == sum(r.num_preemptions for r in created)
    counts["prefix_hits"] = kv.num_prefix_hits
    return counts


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


class QueuesForkedSamples(FIFOScheduler):
    """Broken: forked samples (which hold blocks) queue behind the head, as before issue 10."""

    def add_forked(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.add_request(request)


class CountsRequestsNotSeats(FIFOScheduler):
    """Broken: admits while fewer than max_num_seqs requests run, whatever their samples will add."""

    def has_seats(self, request: Request) -> bool:
        return self.num_running < self.config.max_num_seqs


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
ENGINE = dict(kv_cache_memory=40 * 1024, max_model_len=64, dtype="float32", device="cpu", block_size=4,
              max_num_batched_tokens=24, max_num_seqs=5)


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
