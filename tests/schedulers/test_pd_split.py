"""pd-split: a long prompt arriving never stalls running decodes; the balance is one option."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.lab import StepShape, TraceRequest, load_cost_model, simulate
from asyncinfer.request import Request
from asyncinfer.schedulers import SchedulerConfig

CONFIG = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=4096)
DECODERS = 8
LONG_PROMPT = 3000


def trace() -> list[TraceRequest]:
    """Eight requests decoding for a long while; a 3000-token prompt lands in the middle."""
    decoders = [TraceRequest(f"d{i}", 0.0, 32, 150) for i in range(DECODERS)]
    return [*decoders, TraceRequest("long", 2.0, LONG_PROMPT, 4)]


def run(name: str, **options):
    return simulate(trace(), name, config=CONFIG, options=options or None)


def decoder_itl_max(result) -> float:
    return max(g for r in result.records if r.id != "long" for g in r.itls)


@pytest.mark.parametrize("prefill_budget", [32, 128])
def test_inter_token_latency_stays_bounded_while_a_long_prompt_arrives(prefill_budget: int) -> None:
    cost = load_cost_model()
    split = run("pd-split", prefill_budget=prefill_budget)
    fifo = run("fifo")
    # The balance holds step by step: with anything decoding, prompt work <= prefill_budget.
    assert all(s.prefill_tokens <= prefill_budget for s in split.steps if s.decodes)
    assert any(s.prefill_tokens > prefill_budget for s in fifo.steps if s.decodes)
    # Hence a bound on every decoder's inter-token gap: the costliest step the split allows,
    # while the prompt is prefilled, or once the long request decodes beside them (the runner
    # pads decode attention to the longest context, 3004 tokens).
    pad = lambda n: -(-n // 16) * 16  # noqa: E731
    prefilling = StepShape(tokens=DECODERS + prefill_budget, sampled=DECODERS + 1, prefill_seqs=1,
                           decode_keys=DECODERS * pad(32 + 150), prefill_keys=prefill_budget * LONG_PROMPT)
    decoding = StepShape(tokens=DECODERS + 1, sampled=DECODERS + 1, prefill_seqs=0,
                         decode_keys=(DECODERS + 1) * pad(LONG_PROMPT + 4), prefill_keys=0)
    assert decoder_itl_max(split) <= max(cost.cost(prefilling), cost.cost(decoding)) + 1e-9
    assert decoder_itl_max(fifo) > 3 * decoder_itl_max(split)  # FIFO stalls them behind 1000-token chunks
    # The long prompt is not starved, only spread over more steps: its first token comes within half again of
    # FIFO's (a little earlier or later than FIFO's, as the step costs of the cost model have it).
    long_split, long_fifo = (next(r for r in res.records if r.id == "long") for res in (split, fifo))
    assert long_split.finish is not None and long_split.ttft <= 1.5 * long_fifo.ttft


def test_with_nothing_decoding_prompts_use_the_whole_budget() -> None:
    result = simulate([TraceRequest("a", 0.0, 2500, 2)], "pd-split", config=CONFIG, options={"prefill_budget": 16})
    assert [s.prefill_tokens for s in result.steps[:3]] == [1024, 1024, 452]


@pytest.mark.parametrize("name, capped", [("pd-split", True), ("fifo", False)])
def test_real_engine_caps_prompt_work_beside_decodes(tiny_llama: Path, name: str, capped: bool) -> None:
    """The synchronous core of a real engine: four requests decode, then a 150-token prompt arrives."""
    engine = AsyncEngine.from_pretrained(tiny_llama, kv_cache_memory=1 << 20, max_model_len=256, device="cpu",
                                         dtype="float32", max_num_batched_tokens=64, scheduler=name,
                                         scheduler_options={"prefill_budget": 8} if capped else None)
    core = engine.core
    plans = []
    schedule = core.scheduler.schedule

    def recording():
        plan = schedule()
        requests = core.scheduler.requests
        plans.append({rid: (n, requests[rid].is_decode) for rid, n in plan.num_scheduled_tokens.items()})
        return plan

    core.scheduler.schedule = recording
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    for i in range(4):
        core.add_request(Request(f"d{i}", [5 + i, 6, 7], greedy, arrival_time=0.0))
    for _ in range(3):
        core.step()
    core.add_request(Request("long", [(11 * j) % 300 + 3 for j in range(150)], greedy, arrival_time=0.0))
    while core.has_unfinished_requests():
        core.step()
    mixed = [p for p in plans[3:] if any(decode for _, decode in p.values())]
    prompt_work = [sum(n for n, decode in p.values() if not decode) for p in mixed]
    assert max(prompt_work) <= 8 if capped else max(prompt_work) > 8
    assert all(all(f"d{i}" in p for i in range(4)) for p in mixed[:5])  # every decoder ran every step
    assert core.kv.num_free_blocks == core.kv.num_blocks
