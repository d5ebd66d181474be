"""In-process misuse found by a fresh adversarial pass (issue 25, after the lying-inputs round).

``SamplingParams`` checks its values when it is built, but the engine took any instance as it came: a
subclass whose ``__post_init__`` skips the checks carried a NaN temperature or a stop list past
``MAX_STOP_STRINGS`` into the engine, and so did a plain instance whose ``stop`` (or ``stop_token_ids``)
list was grown in place after it was built. The engine now builds each request's parameters again from
what they hold at the call (``sampling_params.plain_params``): refused there, by name, like any bad value.

And a burst of short prompts (each within ``OFF_LOOP_CHARS``, so each tokenized on the event loop) held
the loop for their sum: the loop now tokenizes at most that much in one turn (``prompts.LoopShare``). And a
scheduler plugin's plan that broke the contract for one request failed the whole step: its neighbours too.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, RequestFailedError, SamplingParams
from asyncinfer.core import SchedulerPlanError
from asyncinfer.prompts import OFF_LOOP_CHARS, LoopShare
from asyncinfer.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, plain_params
from asyncinfer.schedulers import FIFOScheduler

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


class Unchecked(SamplingParams):
    """Parameters that skip every check when built."""

    def __post_init__(self) -> None:
        pass


def _grown_stop() -> SamplingParams:
    params = SamplingParams(max_tokens=4, stop=["a"])
    assert isinstance(params.stop, list)
    params.stop.extend(["b"] * MAX_STOP_STRINGS)  # the list is the caller's: it grows after the checks
    return params


def _grown_stop_ids() -> SamplingParams:
    params = SamplingParams(max_tokens=4, stop_token_ids=[1])
    assert params.stop_token_ids is not None
    params.stop_token_ids.extend([1] * MAX_STOP_TOKEN_IDS)
    return params


LYING = {  # what the call must refuse, and the parameter it names
    "nan temperature": (lambda: Unchecked(max_tokens=4, temperature=math.nan), "temperature"),
    "top_p 0": (lambda: Unchecked(max_tokens=4, temperature=1.0, top_p=0.0), "top_p"),
    "stop list past the limit": (lambda: Unchecked(max_tokens=4, stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    "n past its range": (lambda: Unchecked(max_tokens=4, n=10_000), "n"),
    "stop list grown after it was built": (_grown_stop, "stop"),
    "stop ids grown after they were built": (_grown_stop_ids, "stop_token_ids"),
}


@pytest.mark.parametrize("case", LYING)
def test_plain_params_checks_what_the_parameters_hold(case) -> None:
    build, parameter = LYING[case]
    with pytest.raises(InvalidParameterError) as refused:
        plain_params(build())
    assert refused.value.parameter == parameter


def test_plain_params_is_the_requests_own_copy() -> None:
    params = SamplingParams(max_tokens=4, stop=["a"], stop_token_ids=[3], seed=5)
    plain = plain_params(params)
    assert type(plain) is SamplingParams and plain == params
    assert isinstance(params.stop, list) and params.stop_token_ids is not None
    params.stop.append("b")
    params.stop_token_ids.append(4)
    assert plain.stop == ["a"] and plain.stop_token_ids == [3]  # later changes change nothing
    assert type(plain_params(Unchecked(max_tokens=3))) is SamplingParams


async def test_unchecked_parameters_are_refused_at_the_call_and_the_engine_serves_on(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 8)
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        neighbour = asyncio.create_task(engine.generate(GOOD, SamplingParams(max_tokens=8, ignore_eos=True)))
        for case, (build, parameter) in LYING.items():
            for call in (lambda p: engine.generate(GOOD, p), lambda p: engine.stream(GOOD, p).__anext__()):
                with pytest.raises(InvalidParameterError) as refused:
                    await call(build())
                assert refused.value.parameter == parameter, case
        assert (await neighbour).token_ids == expected
        # What the caller changes after the call does not reach the request in flight.
        params = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[0])
        running = asyncio.create_task(engine.generate(GOOD, params))
        await asyncio.sleep(0)
        assert params.stop_token_ids is not None
        params.stop_token_ids[:] = expected[:1]  # would stop it at its first token
        assert (await running).token_ids == expected
    assert engine.kv_stats().used_blocks == 0


async def test_the_loop_tokenizes_at_most_its_share_in_one_turn() -> None:
    """prompts.LoopShare: the engine tokenizes at most OFF_LOOP_CHARS of cost on the loop in one turn of it
    (a burst of short prompts used to be tokenized there one after another, for their sum); the share comes
    back with the next turn."""
    share = LoopShare()
    assert share.take(3000) and not share.take(2000) and share.take(OFF_LOOP_CHARS - 3000) and not share.take(1)
    assert share.take(0)  # token ids cost nothing to tokenize
    assert not LoopShare().take(OFF_LOOP_CHARS + 1)  # more than the share alone: always off the loop
    await asyncio.sleep(0)
    assert share.take(OFF_LOOP_CHARS)


@pytest.mark.real_model
async def test_a_burst_of_short_prompts_is_tokenized_off_the_loop_past_the_share(real_gguf, monkeypatch) -> None:
    """16 prompts of about 1,000 characters each, submitted together: at most OFF_LOOP_CHARS of them on the
    loop's thread, the others in worker threads, and every reply as it would be alone."""
    async with await AsyncEngine.load(real_gguf, max_model_len=512, max_num_seqs=16) as engine:
        loop = threading.get_ident()
        prompts = [f"{i} " + "Hello world! The quick brown fox. " * 30 for i in range(16)]
        alone = (await engine.generate(prompts[5], SamplingParams(max_tokens=1))).token_ids
        seen: list[tuple[bool, int]] = []
        real_encode = engine.tokenizer.encode

        def spy(text, *args, **kwargs):
            seen.append((threading.get_ident() == loop, len(text)))
            return real_encode(text, *args, **kwargs)

        monkeypatch.setattr(engine.tokenizer, "encode", spy)
        outs = await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=1)) for p in prompts])
        assert len(seen) == len(prompts)
        assert sum(chars for on_loop, chars in seen if on_loop) <= OFF_LOOP_CHARS
        assert outs[5].token_ids == alone


def _misplanning(kind: str) -> type[FIFOScheduler]:
    """FIFO, but its plan breaks the contract for the request whose id starts with "bad" (``kind``)."""

    class Misplanning(FIFOScheduler):
        def schedule(self):  # type: ignore[no-untyped-def]
            out = super().schedule()
            entries = out.num_scheduled_tokens
            rid = next((r for r in entries if r.startswith("bad")), None)
            if rid is None:
                return out
            if kind == "more than it lacks":
                entries[rid] += 3
            elif kind == "zero":
                entries[rid] = 0
            elif kind == "negative":
                entries[rid] = -1
            elif kind == "float":
                entries[rid] = float(entries[rid])
            elif kind == "unknown id":
                entries["nobody"] = 1
            elif kind == "bool":
                entries[rid] = True
            elif kind == "preempted in schedule":  # still planned after the plugin preempted it itself
                self.preempt(self.requests[rid])
            return out

    return Misplanning


@pytest.mark.parametrize("kind", ["more than it lacks", "zero", "negative", "float", "unknown id", "bool",
                                  "preempted in schedule"])
async def test_a_plan_that_breaks_the_contract_for_one_request_fails_it_alone(
        tiny_models, hf_greedy, kind, caplog) -> None:
    """A plugin's plan giving one request a count the contract forbids (more tokens than it lacks, none, a
    negative or non-int count) failed the whole step, so every neighbour in it, with RequestFailedError; an
    entry for an id the scheduler does not hold failed every request it held. Now the entry leaves the plan:
    its request fails alone (the cause a SchedulerPlanError, logged), an unknown id is just left out, and no
    step fails."""
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 8)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    async with AsyncEngine.from_pretrained(path, **BASE, scheduler=_misplanning(kind)) as engine:
        neighbours = [asyncio.create_task(engine.generate(GOOD, greedy)) for _ in range(2)]
        bad = asyncio.create_task(engine.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True, n=2),
                                                  request_id="bad"))
        results = await asyncio.gather(*neighbours, bad, return_exceptions=True)
        assert [r.token_ids for r in results[:2]] == [expected, expected]  # type: ignore[union-attr]
        if kind == "unknown id":
            assert len(results[2].outputs) == 2  # type: ignore[union-attr]
            assert "does not hold" in caplog.text
        else:
            assert isinstance(results[2], RequestFailedError) and "'bad'" in str(results[2])
            assert isinstance(results[2].__cause__, SchedulerPlanError)
            assert "its scheduler's plan" in caplog.text
        assert (await engine.generate(GOOD, greedy)).token_ids == expected
        assert engine.step_stats().failed_steps == 0
    assert engine.kv_stats().used_blocks == 0 and engine.kv_manager.request_ids() == []
