"""``n > 1`` samples and request ids in the synchronous core (issue 10, items 1 and 2).

Forked samples hold KV blocks from the step that forks them, so they must run at
once: queued behind a request that needs those very blocks, nothing could run
again. A request of ``n`` samples takes ``n`` seats of ``max_num_seqs`` from its
admission. The core refuses an id it already holds, and a sample's internal id
(``"<id>#<i>"``) is not abortable from outside.
"""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.request import Request

# The tiny Llama: 2 layers x 2 KV heads x head_dim 16, float32 -> 2048 bytes per 4-token block.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4
SMALL = {"kv_cache_memory": 10 * BLOCK_BYTES, "block_size": 4, "max_model_len": 40, "dtype": "float32", "device": "cpu"}
PROMPT_16 = [(7 * j) % 300 + 3 for j in range(16)]  # exactly 4 full blocks
PROMPT_28 = [(11 * j) % 300 + 5 for j in range(28)]  # 7 blocks


def greedy(n_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n_tokens, ignore_eos=True, n=n)


def run(core, max_steps: int = 200) -> list:
    outputs = []
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return outputs
        outputs.extend(core.step())
    raise AssertionError(f"no end after {max_steps} steps: the engine stopped making progress")


def tokens_by_sample(outputs, request_id: str, n: int) -> list[list[int]]:
    got: list[list[int]] = [[] for _ in range(n)]
    for out in outputs:
        if out.request_id == request_id:
            got[out.index].extend(out.token_ids)
    return got


@pytest.mark.parametrize("scheduler", ["fifo", "pd-split"])
def test_forked_samples_run_at_once_instead_of_waiting_behind_the_queue_head(
    scheduler: str, tiny_models, hf_greedy
) -> None:
    """10 blocks. A (n=2, 16-token prompt) runs; B (28 tokens: 7 blocks) waits for memory.
    A's second sample shares A's 4 prompt blocks. Behind B it would hold them forever
    while B waits for them (A alone frees only 2): the lock-up of issue 10."""
    path, hf = tiny_models["llama"]
    core = AsyncEngine.from_pretrained(path, **SMALL, scheduler=scheduler).core
    assert core.kv.num_blocks == 10 and core.kv.watermark_blocks == 0
    a = Request("a", PROMPT_16, greedy(8, n=2), arrival_time=0.0)
    b = Request("b", PROMPT_28, greedy(4), arrival_time=0.0)
    core.add_request(a)
    core.add_request(b)
    core.step()  # A's prompt: 4 blocks; B does not fit in the 6 left
    assert core.kv.num_free_blocks == 6 and list(core.scheduler.waiting) == [b]
    sibling = core.scheduler.requests["a#1"]
    assert sibling in core.scheduler.running and sibling.num_output_tokens == 1
    outputs = run(core)
    expected_a = hf_greedy(hf, PROMPT_16, 8)
    assert tokens_by_sample(outputs, "a", 2) == [expected_a[1:], expected_a[1:]]  # the first token came in step 1
    assert a.output_token_ids == sibling.output_token_ids == expected_a
    assert b.output_token_ids == hf_greedy(hf, PROMPT_28, 4)
    assert core.kv.num_free_blocks == 10 and core.kv.request_ids() == []


def test_n_samples_take_n_seats_and_decode_together(tiny_models, hf_greedy) -> None:
    """max_num_seqs=2: a request of 2 samples fills both seats from its admission; the
    sample forked from it decodes beside it, not behind the request queued after it."""
    path, hf = tiny_models["llama"]
    core = AsyncEngine.from_pretrained(path, **{**SMALL, "kv_cache_memory": 40 * BLOCK_BYTES}, max_num_seqs=2).core
    a = Request("a", PROMPT_16, greedy(6, n=2), arrival_time=0.0)
    d = Request("d", PROMPT_16[:5], greedy(3), arrival_time=0.0)
    core.add_request(a)
    core.add_request(d)
    core.step()
    assert core.scheduler.running == [a, core.scheduler.requests["a#1"]] and list(core.scheduler.waiting) == [d]
    core.step()
    assert core.scheduler.requests["a#1"].num_output_tokens == 2 and d.num_output_tokens == 0
    running_sizes = []
    while core.has_unfinished_requests():
        core.step()
        running_sizes.append(core.scheduler.num_running)
    assert max(running_sizes) <= 2
    assert (a.num_seqs, d.num_seqs) == (1, 1)  # a's second seat went to its forked sample
    assert a.output_token_ids == hf_greedy(hf, PROMPT_16, 6)
    assert d.output_token_ids == hf_greedy(hf, PROMPT_16[:5], 3)


def test_more_samples_than_max_num_seqs_fail_alone(tiny_models) -> None:
    core = AsyncEngine.from_pretrained(tiny_models["llama"][0], **SMALL, max_num_seqs=2).core
    outs = core.add_request(Request("wide", PROMPT_16, greedy(4, n=3), arrival_time=0.0))
    assert [(o.request_id, o.index, o.finish_reason) for o in outs] == [("wide", i, "abort") for i in range(3)]
    assert isinstance(outs[0].error, InvalidParameterError) and outs[0].error.parameter == "n"
    assert not core.has_unfinished_requests()


def test_the_core_refuses_an_id_it_holds_and_serves_the_first(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    core = AsyncEngine.from_pretrained(path, **{**SMALL, "kv_cache_memory": 40 * BLOCK_BYTES}).core
    first = Request("x", PROMPT_16, greedy(5, n=2), arrival_time=0.0)
    assert core.add_request(first) == []
    # The same id, and ids of x's samples (before and after they fork), are all taken.
    for rid, n in (("x", 1), ("x#1", 1), ("w", 1)):
        if rid == "w":
            core.step()  # x forks x#1
            rid = "x#1"
        outs = core.add_request(Request(rid, PROMPT_16[:3], greedy(2, n=n), arrival_time=0.0))
        assert len(outs) == 1 and outs[0].finish_reason == "abort" and outs[0].request_id == rid
        assert isinstance(outs[0].error, InvalidParameterError) and outs[0].error.parameter == "request_id"
    # A new request whose future sample ids would collide with x's live samples is refused too.
    outs = core.add_request(Request("x", PROMPT_16[:3], greedy(2), arrival_time=0.0))
    assert isinstance(outs[0].error, InvalidParameterError)
    run(core)
    expected = hf_greedy(hf, PROMPT_16, 5)
    assert first.output_token_ids == expected
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_an_internal_sample_id_is_not_abortable(tiny_models, hf_greedy) -> None:
    """Aborting "z#1" used to end that sample alone and leak the request's group forever."""
    path, hf = tiny_models["llama"]
    core = AsyncEngine.from_pretrained(path, **{**SMALL, "kv_cache_memory": 40 * BLOCK_BYTES}).core
    z = Request("z", PROMPT_16, greedy(6, n=3), arrival_time=0.0)
    core.add_request(z)
    outputs = core.step()
    assert sorted(core.scheduler.requests) == ["z", "z#1", "z#2"]
    assert core.abort_request("z#1") == [] and core.abort_request("z#2") == []
    outputs += run(core)
    expected = hf_greedy(hf, PROMPT_16, 6)
    assert tokens_by_sample(outputs, "z", 3) == [expected] * 3
    assert sorted((o.index, o.finish_reason) for o in outputs if o.finish_reason) == [(i, "length") for i in range(3)]
    assert core.abort_request("z") == []  # over: nothing of it is left in the core
    assert core.kv.num_free_blocks == core.kv.num_blocks


async def test_the_most_samples_on_the_smallest_kv_budget_all_finish_with_their_own_tokens(tiny_models, hf_greedy) -> None:
    """n=64 (the maximum) with KV blocks for one max_model_len request and two more: the samples
    preempt each other (a sibling holding only shared blocks frees nothing), yet every one finishes,
    within a time limit, with exactly its own tokens: greedy ones transformers', and seeded sample
    ``i`` those of a lone request with ``seed + i``. Every block comes back."""
    import asyncio

    path, hf = tiny_models["llama"]
    prompt = PROMPT_16[:8]
    options = {**SMALL, "kv_cache_memory": 6 * BLOCK_BYTES, "max_model_len": 16, "max_num_seqs": 64}
    async with await AsyncEngine.load(path, **options) as engine:
        assert engine.kv_manager.num_blocks == 6  # one request of max_model_len takes 4
        greedy_out = await asyncio.wait_for(engine.generate(prompt, greedy(8, n=64)), 300)
        expected = hf_greedy(hf, prompt, 8)
        assert [o.token_ids for o in greedy_out.outputs] == [expected] * 64
        assert all(o.finish_reason == "length" for o in greedy_out.outputs)
        seeded = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=11, n=64)
        out = await asyncio.wait_for(engine.generate(prompt, seeded), 300)
        assert len(out.outputs) == 64 and all(len(o.token_ids) == 8 for o in out.outputs)
        for i in (0, 1, 37, 63):
            alone = await engine.generate(prompt, seeded.with_updates(n=1, seed=11 + i))
            assert out.outputs[i].token_ids == alone.token_ids, i
        assert engine.step_stats().preemptions > 0  # the pressure path ran
    assert engine.kv_stats().used_blocks == 0 and engine.kv_manager.request_ids() == []
