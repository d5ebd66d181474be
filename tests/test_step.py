"""One step's bookkeeping: what a decode is, and applying a step's results (asyncinfer.step)."""

from __future__ import annotations

import pytest

from asyncinfer.cache import KVCacheManager
from asyncinfer.request import Request, RequestStatus
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers import FIFOScheduler, SchedulerConfig
from asyncinfer.step import apply_step, scheduled


def make(prompt_len: int, *, computed: int, outputs: int = 0) -> Request:
    request = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=8), arrival_time=0.0)
    request.output_token_ids.extend([7] * outputs)
    request.num_computed_tokens = computed
    return request


def test_a_decode_computes_the_last_sampled_token() -> None:
    assert make(5, computed=5, outputs=1).is_decode  # first token sampled: feed it back
    assert make(5, computed=7, outputs=3).is_decode


def test_prompt_work_is_never_a_decode_even_one_token_long() -> None:
    assert not make(5, computed=0).is_decode
    assert not make(5, computed=4).is_decode  # last prompt token (a chunk or a prefix-cache hit left it)
    assert not make(1, computed=0).is_decode  # a one-token prompt


def test_recomputation_is_prefill_until_only_the_last_token_is_left() -> None:
    assert not make(5, computed=0, outputs=3).is_decode  # just preempted
    assert not make(5, computed=6, outputs=3).is_decode  # two tokens left
    assert make(5, computed=7, outputs=3).is_decode


def fifo(budget: int = 6, max_model_len: int = 8) -> FIFOScheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len)
    return FIFOScheduler(config, KVCacheManager(16, 4, watermark=0.0))


def req(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)


def test_a_scripted_run_counts_and_finishes_exactly() -> None:
    """a: 4-token prompt, 2 tokens out. b: 5-token prompt, cut at max_model_len = 8. 6 tokens a step."""
    sched = fifo()
    a, b = req("a", 4, 2), req("b", 5, 10)
    sched.add_request(a)
    sched.add_request(b)
    steps = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        result = apply_step(sched, plan, len(steps))  # the token is the step's number
        steps.append((dict(plan.num_scheduled_tokens), result.prefill_tokens, result.decode_tokens,
                      [(r.request_id, t) for r, t in result.sampled], [r.request_id for r in result.finished]))
    assert steps == [
        ({"a": 4, "b": 2}, 6, 0, [("a", 0)], []),  # a's prompt, a chunk of b's
        ({"a": 1, "b": 3}, 3, 1, [("a", 1), ("b", 1)], ["a"]),  # a decodes its 2nd token: max_tokens
        ({"b": 1}, 0, 1, [("b", 2)], []),
        ({"b": 1}, 0, 1, [("b", 3)], ["b"]),  # 5 + 3 tokens = max_model_len
    ]
    assert (a.output_token_ids, b.output_token_ids) == ([0, 1], [1, 2, 3])
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 7)  # the last token is never computed
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert not sched.requests and sched.kv.num_free_blocks == 16


def test_stop_hook_goes_before_the_length_rule_and_sample_may_add_requests() -> None:
    sched = fifo(budget=16, max_model_len=64)
    c, d = req("c", 3, 5), req("d", 3, 1)
    sched.add_request(c)
    sched.add_request(d)
    forked = req("c#1", 3, 1)  # as the core's n > 1 samples: not in the scheduler yet
    script = {"c": [11, 13], "d": [13], "c#1": [12]}

    def sample(caught_up: list[Request]) -> list[tuple[Request, int]]:
        extra = [forked] if c in caught_up and not c.output_token_ids else []
        return [(r, script[r.request_id][r.num_output_tokens]) for r in [*caught_up, *extra]]

    def stop_on_13(request: Request, token_id: int) -> None:
        if token_id == 13:
            request.status = RequestStatus.FINISHED_STOPPED

    first = apply_step(sched, sched.schedule(), sample, stop_on_13)
    assert [(r.request_id, t) for r, t in first.sampled] == [("c", 11), ("d", 13), ("c#1", 12)]
    # d reached max_tokens with a stop token: the stop wins. The fork ends by length.
    assert [(r.request_id, r.status) for r in first.finished] == [
        ("d", RequestStatus.FINISHED_STOPPED), ("c#1", RequestStatus.FINISHED_LENGTH)]
    assert (first.prefill_tokens, first.decode_tokens) == (6, 0)  # the fork computed nothing
    assert list(sched.requests) == ["c"]
    second = apply_step(sched, sched.schedule(), sample, stop_on_13)
    assert (second.decode_tokens, [r.request_id for r in second.finished]) == (1, ["c"])
    assert c.output_token_ids == [11, 13] and c.status is RequestStatus.FINISHED_STOPPED


def test_no_token_is_drawn_when_nobody_caught_up() -> None:
    sched = fifo(budget=4)
    sched.add_request(req("long", 10, 1))

    def never(caught_up: list[Request]) -> list[tuple[Request, int]]:
        raise AssertionError("sampled mid-prompt")

    for computed in (4, 8):
        result = apply_step(sched, sched.schedule(), never)
        assert (result.prefill_tokens, result.sampled, result.finished) == (4, [], [])
        assert sched.requests["long"].num_computed_tokens == computed
    with pytest.raises(AssertionError, match="mid-prompt"):
        apply_step(sched, sched.schedule(), never)  # the last 2 prompt tokens: now it samples


def test_a_request_is_stamped_when_first_scheduled_on_the_schedulers_clock() -> None:
    """a: 4-token prompt, b: 5, 6 tokens a step. b is first scheduled with a (a chunk), c waits for a seat."""
    sched = fifo()
    now = [10.0]
    sched.clock = lambda: now[0]  # type: ignore[method-assign]
    a, b = req("a", 4, 2), req("b", 5, 1)
    sched.add_request(a)
    sched.add_request(b)
    assert a.scheduled_time is None and b.scheduled_time is None
    plan = sched.schedule()
    batch = scheduled(sched, plan)
    assert [(r.request_id, n) for r, n in batch] == [("a", 4), ("b", 2)]
    assert (a.scheduled_time, b.scheduled_time) == (10.0, 10.0)
    now[0] = 11.5
    apply_step(sched, plan, 0)  # calls scheduled() again: the first stamp stays
    c = req("c", 2, 1)
    sched.add_request(c)
    apply_step(sched, sched.schedule(), 0)
    assert (a.scheduled_time, b.scheduled_time, c.scheduled_time) == (10.0, 10.0, 11.5)
