"""length-bucket: on a mixed-length load, short requests stop queueing behind long ones."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.cache import KVCacheManager
from asyncinfer.lab import StepCostModel, StepShape, TraceRequest, simulate, summarize
from asyncinfer.models.attention.sdpa import SdpaBackend
from asyncinfer.request import Request, RequestStatus
from asyncinfer.schedulers import LengthBucketScheduler, SchedulerConfig
from asyncinfer.step import apply_step
from tests.helpers import CPU_COST


def mixed_burst() -> list[TraceRequest]:
    """48 requests in 6 s; every fourth is long (1500-token prompt, 200 tokens out), the rest short."""
    out = []
    for i in range(48):
        long = i % 4 == 0
        out.append(TraceRequest(f"r{i}", round(0.125 * i, 6), 1500 if long else 40, 200 if long else 20))
    return out


def padding_waste(result) -> float:
    """Share of the batched decode attention spent on padding to the longest context of a step."""
    keys = sum(s.decode_keys for s in result.steps)
    return 1 - sum(s.decode_context for s in result.steps) / keys


def test_beats_fifo_on_padding_throughput_and_latency() -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096)
    trace = mixed_burst()
    fifo = simulate(trace, "fifo", cost_model=CPU_COST, config=config)
    bucket = simulate(trace, "length-bucket", cost_model=CPU_COST, config=config)
    f, b = summarize("fifo", fifo.records), summarize("length-bucket", bucket.records)
    # Short and long contexts decode on alternate steps instead of padding to the longest...
    assert padding_waste(bucket) < 0.25 * padding_waste(fifo)
    assert b.throughput > 1.05 * f.throughput
    # ...and short requests no longer wait behind long ones.
    assert b.ttft_p50 < 0.5 * f.ttft_p50
    assert b.e2e_mean < 0.7 * f.e2e_mean
    assert b.e2e_p99 <= f.e2e_p99
    # Without the alternation only the queueing gain remains.
    plain = simulate(trace, "length-bucket", cost_model=CPU_COST, config=config, options={"split_padding": None})
    assert padding_waste(plain) > 0.8 * padding_waste(fifo)
    assert summarize("plain", plain.records).e2e_mean < f.e2e_mean
    # A backend that says it pads nothing never gets its decodes split (the lab still counts SDPA's cost).
    unpadded = dataclasses.replace(config, decode_padding=lambda contexts, block_size: 0)
    no_split = simulate(trace, "length-bucket", cost_model=CPU_COST, config=unpadded)
    assert [s.decodes for s in no_split.steps] == [s.decodes for s in plain.steps]


def decode_rounds(decode_padding) -> list[dict[str, int]]:
    """Three short prompts and a long one, prefilled together; then the first two decode steps."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096,
                             decode_padding=decode_padding)
    sched = LengthBucketScheduler(config, KVCacheManager(256, 16, watermark=0.0))
    for rid, prompt in (("s0", 20), ("s1", 20), ("s2", 20), ("long", 2000)):
        sched.add_request(Request(rid, [7] * prompt, SamplingParams(max_tokens=10), arrival_time=0.0))
    rounds = []
    for _ in range(3):
        out = sched.schedule()
        sched.kv.commit_step()
        rounds.append(out.num_scheduled_tokens)
        apply_step(sched, out, 0)
    return rounds[1:]


def test_decodes_split_by_the_padding_the_backend_reports() -> None:
    # SDPA pads the contexts 21, 21, 21 and 2001 to 2016 keys each: 6000 padded keys, and
    # resting the long one saves 5952 > split_padding (4096); the two groups take turns.
    assert SdpaBackend.decode_padding([21, 21, 21, 2001], 16) == 6000
    assert decode_rounds(SdpaBackend.decode_padding) == [{"s0": 1, "s1": 1, "s2": 1}, {"long": 1}]
    every_decode = {"s0": 1, "s1": 1, "s2": 1, "long": 1}
    assert decode_rounds(None) == [every_decode, every_decode]  # the backend pads nothing
    assert decode_rounds(lambda contexts, block_size: 0) == [every_decode, every_decode]


def test_the_lab_counts_decode_keys_with_the_sdpa_backends_padding() -> None:
    # Decodes of 5, 20 and 41 tokens (computed + 1 new), and a 6-token prefill chunk.
    shape = StepShape.from_batch([(4, 1, 5), (19, 1, 20), (40, 1, 41), (0, 6, 9)], block_size=16)
    assert shape.decode_keys == 3 * 48  # every decode padded to 48 keys
    assert shape.decode_keys == 5 + 20 + 41 + SdpaBackend.decode_padding([5, 20, 41], 16)


ONE_AT_A_TIME = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=512)


@pytest.mark.parametrize("max_wait", [2.0, 5.0])
def test_a_long_request_waits_at_most_max_wait_under_a_stream_of_short_ones(max_wait: float) -> None:
    # Steps cost 0.1 s; a short request (4-token prompt, 5 out) takes 0.5 s; one arrives
    # every 0.4 s for a minute, so shortest-first alone would never get to the long one.
    trace = [TraceRequest(f"s{i}", round(0.4 * i, 6), 4, 5) for i in range(150)]
    trace.append(TraceRequest("long", 1.0, 300, 5))

    def long_wait(**options) -> float:
        result = simulate(trace, "length-bucket", cost_model=StepCostModel({"const": 0.1}), config=ONE_AT_A_TIME,
                          num_blocks=64, block_size=16, options=options)
        return next(r.wait for r in result.records if r.id == "long")

    assert max_wait <= long_wait(max_wait=max_wait) <= max_wait + 0.5 + 1e-9  # + the request then in service
    assert long_wait(max_wait=1e6) > 60.0


def stop_at_once(request: Request, token_id: int) -> None:
    request.status = RequestStatus.FINISHED_STOPPED


def test_admission_order_buckets_then_arrival() -> None:
    sched = LengthBucketScheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512), KVCacheManager(256, 4),
                                  bucket_edges=[16, 64, 256], max_wait=10.0)
    now = [0.0]
    sched.clock = lambda: now[0]
    lengths = {"long": (200, 8), "mid": (40, 8), "short": (4, 4), "short2": (6, 4)}
    for t, (rid, (p, n)) in enumerate(lengths.items()):
        sched.add_request(Request(rid, [1] * p, SamplingParams(max_tokens=n), arrival_time=float(t)))
    assert [sched.bucket_of(r) for r in sched.waiting] == [2, 1, 0, 0]
    order = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        (rid,) = out.num_scheduled_tokens
        order.append(rid)
        # Each prompt fits in one step; its first token stops it.
        finished = apply_step(sched, out, 0, check_stop=stop_at_once).finished
        assert [r.request_id for r in finished] == [rid]
        now[0] += 5.0  # by the third pick, "long" (arrived at 0) has waited 10 s
    assert order == ["short", "short2", "long", "mid"]


def test_real_engine_serves_short_requests_first(tiny_llama: Path) -> None:
    """Synchronous core of a real engine, two sequences at a time: four long requests, then four short."""

    def short_finish_steps(name: str) -> list[int]:
        engine = AsyncEngine.from_pretrained(tiny_llama, kv_cache_memory=1 << 20, max_model_len=256, device="cpu",
                                             dtype="float32", max_num_seqs=2, scheduler=name)
        core = engine.core
        assert core.scheduler.config.decode_padding([5, 20], 16) == 27 + 12  # the engine's backend: SDPA
        now = time.time()  # the engine's clock: max_wait (30 s) never expires in this test
        reqs = [Request(f"long{i}", [(7 * i + j) % 300 + 3 for j in range(120)],
                        SamplingParams(max_tokens=40, ignore_eos=True), arrival_time=now) for i in range(4)]
        reqs += [Request(f"short{i}", [5 + i, 6, 7, 8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True),
                         arrival_time=now) for i in range(4)]
        for r in reqs:
            core.add_request(r)
        finished_at: dict[str, int] = {}
        step = 0
        while core.has_unfinished_requests():
            step += 1
            for out in core.step():
                if out.finish_reason:
                    finished_at[out.request_id] = step
        assert len(finished_at) == 8 and core.kv.num_free_blocks == core.kv.num_blocks
        return [finished_at[f"short{i}"] for i in range(4)]

    fifo, bucket = short_finish_steps("fifo"), short_finish_steps("length-bucket")
    assert max(bucket) < min(fifo)
    assert sum(bucket) < 0.2 * sum(fifo)
