"""Pass 24: the Python API as an application embeds it (one engine, many coroutines of different users).

Seeded sampling with every sampling option, alone, beside different neighbours, as one of ``n`` samples, after
preemption and with the prefix cache on or off; consumers that misbehave (one stream read by two tasks, a stream
abandoned in a task that is garbage-collected, calls from another thread); memory over thousands of requests.
"""

from __future__ import annotations

import asyncio
import gc
import random
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.errors import WrongEventLoopError
from asyncinfer.request import Request
from asyncinfer.schedulers import FIFOScheduler

BASE = {"max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4, "num_threads": 1}
PROMPT = [(11 * j) % 300 + 5 for j in range(33)]
SEED = 77

#: One seeded request's parameters for each sampling option, and all of them together.
OPTIONS: dict[str, dict[str, object]] = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": -1.2},
    "repetition": {"repetition_penalty": 1.7},
    "top_k": {"top_k": 7},
    "top_p": {"top_p": 0.6},
    "min_p": {"min_p": 0.2},
    "min_tokens_stop_ids": {"min_tokens": 12, "stop_token_ids": [7, 19, 101, 250]},
    "logprobs": {"logprobs": 5},
    "all": {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.3, "top_k": 40,
            "top_p": 0.9, "min_p": 0.02, "min_tokens": 6, "stop_token_ids": [7, 19], "logprobs": 3},
}


def seeded(option: str, seed: int = SEED, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=1.1, seed=seed, n=n, **OPTIONS[option])  # type: ignore[arg-type]


def neighbour(rng: random.Random) -> tuple[list[int], SamplingParams]:
    prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 40))]
    params = rng.choice([
        SamplingParams(max_tokens=rng.randrange(4, 40), ignore_eos=True),
        SamplingParams(max_tokens=rng.randrange(4, 40), temperature=0.9, presence_penalty=-2.0, ignore_eos=True),
        SamplingParams(max_tokens=rng.randrange(4, 40), temperature=1.3, frequency_penalty=2.0, top_k=3,
                       seed=rng.randrange(1000), n=2, ignore_eos=True),
        SamplingParams(max_tokens=rng.randrange(20, 40), temperature=0.5, repetition_penalty=0.05, min_p=0.3,
                       min_tokens=20, stop_token_ids=list(range(3, 60)), logprobs=20),
    ])
    return prompt, params


async def load(engine: AsyncEngine, rng: random.Random, count: int) -> None:
    """``count`` neighbours submitted a few milliseconds apart, run to their ends."""
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(engine.generate(*neighbour(rng))))
        await asyncio.sleep(rng.random() * 0.003)
    await asyncio.gather(*tasks)


def key(out) -> tuple[object, ...]:
    """A sample's tokens, finish reason and reported alternatives (their ids; the values are compared apart: float32
    rows move in their last bits with the batch's shape, documented in docs/reliability.md)."""
    lps = None if out.logprobs is None else [(lp.token_id, tuple(t for t, _ in lp.top)) for lp in out.logprobs]
    return tuple(out.token_ids), out.finish_reason, lps


async def test_seeded_sampling_with_every_option_depends_on_the_request_only(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    alone: dict[tuple[str, int], tuple[object, ...]] = {}
    for caching in (True, False):  # alone, on an idle engine, with the prefix cache on and off
        engine = await AsyncEngine.load(path, **BASE, kv_cache_memory=4 * 1024 * 1024,
                                        enable_prefix_caching=caching)
        async with engine:
            for option in OPTIONS:
                for i in range(3):
                    got = key((await engine.generate(PROMPT, seeded(option, SEED + i))).outputs[0])
                    assert alone.setdefault((option, i), got) == got, (option, i, caching)
    assert len({alone[("all", i)][0] for i in range(3)}) == 3  # the seeds matter
    assert all(alone[(o, 0)][0] != alone[("top_k", 0)][0] for o in OPTIONS if o != "top_k")  # so do the options

    # Beside different neighbours, as n = 3 samples, on 40 KV blocks (preempted and recomputed), 20 tokens a step
    # (prefills chunked beside decodes), the prompt found in the prefix cache by the later ones.
    for caching in (True, False):
        rng = random.Random(3)
        engine = await AsyncEngine.load(path, **BASE, kv_cache_memory=40 * 2 * 2 * 2 * 4 * 16 * 4,
                                        max_num_batched_tokens=20, max_num_seqs=8, enable_prefix_caching=caching)
        async with engine:
            for option in OPTIONS:
                traffic = asyncio.create_task(load(engine, rng, 6))
                await asyncio.sleep(0.002)
                group = asyncio.create_task(engine.generate(PROMPT, seeded(option, n=3)))
                singles = [asyncio.create_task(engine.generate(PROMPT, seeded(option, SEED + i))) for i in (2, 0, 1)]
                await traffic
                assert [key(o) for o in (await group).outputs] == [alone[(option, i)] for i in range(3)], option
                assert [key((await t).outputs[0]) for t in singles] == [alone[(option, i)] for i in (2, 0, 1)], option
            stats = engine.step_stats()
        assert stats.preemptions > 0, caching


#: Text options (a tokenizer's model): stop strings, kept in the text, only after min_tokens, special tokens kept,
#: truncated to the model's length; each with logprobs.
TEXT_OPTIONS: dict[str, dict[str, object]] = {
    "stop": {"stop": ["t4", "5 t", "9"]},
    "stop_kept": {"stop": ["t4", "5 t"], "include_stop_str_in_output": True},
    "stop_after_min_tokens": {"stop": ["t4", "5 t", "t1"], "min_tokens": 8},
    "special_tokens_kept": {"skip_special_tokens": False, "stop": ["t6"]},
    "truncated": {"truncate_output_to_model_len": True, "presence_penalty": 1.0},
}
TEXT_PROMPT = "hello world t1 t2"


def text_seeded(option: str, seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, n=n, logprobs=2,
                          **TEXT_OPTIONS[option])  # type: ignore[arg-type]


def text_key(out) -> tuple[object, ...]:
    return tuple(out.token_ids), out.text, out.finish_reason, out.stop_reason


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make_gguf's tiny float16 file: random weights, a vocabulary of its own and a tokenizer."""
    model = tmp_path_factory.mktemp("pass24") / "tiny.gguf"
    made = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" / "make_gguf.py"),
                           str(model), "--shape", "tiny", "--type", "f16"], check=False, capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    return model


async def test_seeded_sampling_with_stop_strings_and_text_options_depends_on_the_request_only(tiny_gguf: Path) -> None:
    """The same on make_gguf's tiny file (its own vocabulary, a tokenizer): stop strings, kept or not, looked for
    after min_tokens, special tokens in the text, truncation: tokens, text, finish and stop reasons."""
    model = tiny_gguf
    options = {"max_model_len": 128, "num_threads": 1, "block_size": 4}
    alone: dict[tuple[str, int], tuple[object, ...]] = {}
    async with await AsyncEngine.load(model, **options, kv_cache_memory=4 * 2**20) as engine:
        for option in TEXT_OPTIONS:
            for i in range(3):
                alone[option, i] = text_key((await engine.generate(TEXT_PROMPT, text_seeded(option, 100 + i))).outputs[0])
    assert {alone[o, i][2] for o in TEXT_OPTIONS for i in range(3)} == {"stop", "length"}
    rng = random.Random(1)
    async with await AsyncEngine.load(model, **options, kv_cache_memory=36 * 8192,  # 36 blocks of 4 tokens
                                      max_num_batched_tokens=20, max_num_seqs=8) as engine:
        async def neighbours() -> None:
            tasks = []
            for _ in range(6):
                prompt = " ".join(f"t{rng.randrange(900)}" for _ in range(rng.randrange(2, 6)))
                params = SamplingParams(max_tokens=rng.randrange(5, 40), temperature=rng.choice([0.0, 1.2]),
                                        n=rng.choice([1, 2]), stop=["t3"], ignore_eos=True)
                tasks.append(asyncio.create_task(engine.generate(prompt, params)))
                await asyncio.sleep(rng.random() * 0.003)
            await asyncio.gather(*tasks)

        for option in TEXT_OPTIONS:
            traffic = asyncio.create_task(neighbours())
            await asyncio.sleep(0.002)
            group = asyncio.create_task(engine.generate(TEXT_PROMPT, text_seeded(option, 100, n=3)))
            singles = [asyncio.create_task(engine.generate(TEXT_PROMPT, text_seeded(option, 100 + i)))
                       for i in range(3)]
            await traffic
            assert [text_key(o) for o in (await group).outputs] == [alone[option, i] for i in range(3)], option
            assert [text_key((await t).outputs[0]) for t in singles] == [alone[option, i] for i in range(3)], option
        assert engine.step_stats().preemptions > 0 and engine.kv_stats().prefix_hits > 0


# ---- consumers that misbehave ----------------------------------------------------------------------------------

SMALL = {**BASE, "kv_cache_memory": 1024 * 1024, "max_num_seqs": 6}


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


async def settled(engine: AsyncEngine) -> None:
    """Wait until the engine holds nothing (aborts confirmed by the engine thread), at most 5 s."""
    for _ in range(100):
        gc.collect()
        if engine.num_unfinished_requests == 0 and engine.metrics.num_tracked_requests == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.num_unfinished_requests == 0
    assert engine.metrics.num_tracked_requests == 0
    assert engine.kv_stats().used_blocks == 0


async def test_one_stream_read_by_two_tasks_at_once_serves_the_first_and_leaks_nothing(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    async with await AsyncEngine.load(path, **SMALL) as engine:
        alone = (await engine.generate([5, 6, 7], greedy(40))).token_ids
        stream = engine.stream([5, 6, 7], greedy(40), request_id="shared")

        async def read() -> list[int]:
            got: list[int] = []
            async for delta in stream:
                got += delta.token_ids
            return got

        first, second = await asyncio.gather(read(), read(), return_exceptions=True)
        assert first == alone
        assert isinstance(second, RuntimeError)  # Python's own: one async generator, one reader at a time
        await settled(engine)
        assert (await engine.generate([5, 6, 7], greedy(40), request_id="shared")).token_ids == alone


async def test_a_stream_abandoned_in_a_task_that_is_garbage_collected_is_aborted(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    async with await AsyncEngine.load(path, **SMALL) as engine:
        async def first_delta() -> int:
            stream = engine.stream([5, 6, 7], greedy(120, n=3), request_id="dropped")
            async for delta in stream:
                return len(delta.token_ids)  # the stream is dropped here, never closed by its reader
            return 0

        assert await asyncio.create_task(first_delta()) >= 1
        await settled(engine)  # aborted by the loop's finalizer: blocks back, the id free again
        assert len((await engine.generate([5], greedy(3), request_id="dropped")).token_ids) == 3
        never = engine.stream([5, 6], greedy(10), request_id="never")  # never iterated: nothing is queued
        assert engine.num_unfinished_requests == 0
        del never
        assert len((await engine.generate([5], greedy(3), request_id="never")).token_ids) == 3


async def test_calls_from_another_thread_fail_typed_and_the_documented_way_works(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    async with await AsyncEngine.load(path, **SMALL) as engine:
        alone = (await engine.generate([9, 8, 7], greedy(12))).token_ids
        loop = asyncio.get_running_loop()
        results: dict[str, object] = {}

        def other_thread() -> None:
            for name, call in (("stream", lambda: engine.stream([9], greedy(3))),
                               ("generate", lambda: asyncio.run(engine.generate([9], greedy(3))))):
                try:
                    call()
                except Exception as exc:  # noqa: BLE001 - the test reads its type
                    results[name] = exc
            future = asyncio.run_coroutine_threadsafe(engine.generate([9, 8, 7], greedy(12)), loop)
            results["threadsafe"] = future.result(timeout=60).token_ids

        thread = threading.Thread(target=other_thread)
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.01)
        assert isinstance(results["stream"], WrongEventLoopError)
        assert isinstance(results["generate"], WrongEventLoopError)
        assert results["threadsafe"] == alone
        await settled(engine)


def test_keyboard_interrupt_inside_a_consumer_leaves_an_engine_that_closes_from_the_next_loop(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    held: dict[str, AsyncEngine] = {}
    # Other tests' engines in this process (module fixtures) may hold engine threads of their own: only this
    # engine's must be gone.
    before = {t for t in threading.enumerate() if t.name == "asyncinfer-core"}

    async def app() -> None:
        engine = await AsyncEngine.load(path, **SMALL)
        await engine.start()
        held["engine"] = engine
        neighbour = asyncio.create_task(engine.generate([9, 9, 9], greedy(120)))  # another user's, left running
        async for _ in engine.stream([5, 6, 7], greedy(120)):
            raise KeyboardInterrupt
        await neighbour

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(app())
    engine = held["engine"]

    async def after() -> None:
        with pytest.raises(WrongEventLoopError, match="has closed"):
            await engine.generate([5], greedy(3))
        await asyncio.wait_for(engine.aclose(abort=True), 30)

    asyncio.run(after())
    assert engine.state.value == "closed"
    assert not [t for t in threading.enumerate() if t.name == "asyncinfer-core" and t not in before]


# ---- memory over time ------------------------------------------------------------------------------------------

async def test_thousands_of_short_unique_requests_leave_nothing_behind(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    rng = random.Random(11)
    gc.collect()
    # Requests other tests of this process still hold (module fixtures' engines) are not this engine's.
    before = sum(1 for o in gc.get_objects() if type(o) is Request)
    async with await AsyncEngine.load(path, **{**BASE, "kv_cache_memory": 4 * 1024 * 1024}) as engine:
        for _ in range(8):
            await asyncio.gather(*[
                engine.generate([rng.randrange(3, 300) for _ in range(rng.randrange(3, 30))], greedy(3))
                for _ in range(150)])
        await settled(engine)
        gc.collect()
        # What the engine keeps of 1,200 ended requests: none of them (the scheduler's last step may hold a few).
        assert sum(1 for o in gc.get_objects() if type(o) is Request) - before < 40
        stats = engine.step_stats()
        assert len(stats.batch_sizes) <= 1000


async def test_random_churn_of_streams_aborts_cancels_and_swaps_ends_every_call_and_leaks_nothing(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    rng = random.Random(2)
    async with await AsyncEngine.load(path, **SMALL) as engine:
        await engine.add_model("b", path, **SMALL)

        async def call(i: int) -> str:
            model = rng.choice([None, "b"])
            params = SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=True, n=rng.choice([1, 1, 3]),
                                    temperature=rng.choice([0.0, 1.0]), seed=rng.choice([None, 5]),
                                    logprobs=rng.choice([None, 2]))
            prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 50))]
            rid, kind = f"r{i % 7}", rng.randrange(6)
            try:
                if kind == 0:
                    await engine.generate(prompt, params, model=model)
                elif kind == 1:
                    stream = engine.stream(prompt, params, model=model, request_id=rid)
                    async for _ in stream:
                        if rng.random() < 0.3:
                            break
                    await stream.aclose()  # type: ignore[attr-defined]
                elif kind == 2:
                    task = asyncio.create_task(engine.generate(prompt, params, model=model, request_id=rid))
                    await asyncio.sleep(rng.random() * 0.02)
                    engine.abort(rid)
                    await task
                elif kind == 3:
                    task = asyncio.create_task(engine.generate(prompt, params, model=model))
                    await asyncio.sleep(rng.random() * 0.02)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                elif kind == 4:
                    async def first() -> None:
                        async for _ in engine.stream(prompt, params, model=model):
                            return
                    await asyncio.create_task(first())
                elif rng.random() < 0.3:
                    await engine.swap_model(path, name=model or "default", **SMALL)
                else:
                    await engine.generate(prompt + [999], params, model=model)  # refused: past the vocabulary
            except Exception as exc:  # noqa: BLE001 - counted by type below
                return type(exc).__name__
            return "ok"

        tasks = []
        for i in range(120):
            tasks.append(asyncio.create_task(call(i)))
            await asyncio.sleep(rng.random() * 0.01)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert set(results) <= {"ok", "InvalidParameterError"}  # a prompt past the vocabulary, an id in flight
        assert results.count("ok") > 80
        await settled(engine)
        assert engine.kv_stats("b").used_blocks == 0


# ---- a long waiting queue ----------------------------------------------------------------------------------------

class _CountingQueue(deque):  # type: ignore[type-arg]
    """A waiting queue that counts the membership tests made of it (each one a pass over the queue)."""

    scans = 0

    def __contains__(self, item: object) -> bool:
        type(self).scans += 1
        return super().__contains__(item)


class _CountingFIFO(FIFOScheduler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.waiting = _CountingQueue()


async def test_cancelling_waiting_requests_and_finishing_ones_never_scan_the_waiting_queue(tiny_models) -> None:
    """The engine checked, after each abort and each finish, that the scheduler had let the request go, with a
    pass over the whole waiting queue: 20,000 waiting requests of one caller cancelled together held the engine
    thread, and a running neighbour's stream, for 6.7 s (1.4 s now, one thread), and with a long queue every
    finishing request cost each step a pass over it. The queue is scanned now only when its count says a request
    was left in it (a plugin's hook that kept it, still caught: tests/engine/test_fresh_pass10.py)."""
    path, _ = tiny_models["llama"]
    _CountingQueue.scans = 0
    options = {**BASE, "kv_cache_memory": 4 * 1024 * 1024, "max_num_seqs": 2}
    async with await AsyncEngine.load(path, **options, scheduler=_CountingFIFO) as engine:
        alone = (await engine.generate([5, 6, 7], greedy(60))).token_ids
        neighbour = asyncio.create_task(engine.generate([5, 6, 7], greedy(60)))
        flood = [asyncio.create_task(engine.generate([9, 9, 9, 9], greedy(100))) for _ in range(400)]
        while engine.num_unfinished_requests < 401:
            await asyncio.sleep(0.01)
        for task in flood[2:]:
            task.cancel()
        results = await asyncio.gather(*flood, return_exceptions=True)
        assert sum(isinstance(r, asyncio.CancelledError) for r in results) >= 398
        assert (await neighbour).token_ids == alone
        await settled(engine)
    assert _CountingQueue.scans == 0
