"""In-process misuse found by a third fresh adversarial pass (issue 25): values whose type lies.

The engine already copied a ``str`` or ``list`` subclass into the plain value it holds before checking it,
but took an ``int`` subclass as it came, and such an int's comparisons are its own: one whose ``__lt__`` and
``__ge__`` answer as if it held another number passes every range check whatever it holds. A token id of a million in a
prompt (the vocabulary has 320) passed ``0 <= t < vocab_size`` and failed, with an ``IndexError`` in the
model's embedding, the step of every request batched with it. ``SamplingParams`` took such ints (and float
subclasses) as they came too: ``n`` of ten thousand samples, a negative ``max_tokens`` or ``seed``, a
``logprobs`` of a million passed their checks, and the ten thousand samples ended the call with a bare
``RuntimeError``. Both now read the plain number the value holds before checking it, and keep that.

The same for the request's strings: a ``request_id`` or ``cache_salt`` given as a ``str`` subclass was kept as
it came, and the engine thread keys its tables by them: a subclass whose ``__hash__`` raised there (and only
there) killed the engine for everyone (the id) or failed its neighbours' step (the salt). Both are now the
plain ``str`` they hold, and the priority the plain ``int``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.plain import plain_value
from asyncinfer.sampling_params import plain_params
from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput
from tests.helpers import Posing, PosingFloat

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


def test_plain_value_reads_the_number_an_int_holds() -> None:
    assert [type(plain_value(t)) for t in (5, Posing(10**6, 5))] == [int, int] and plain_value(Posing(10**6, 5)) == 10**6
    assert plain_value(True) is True and plain_value("7") == "7"  # a bool stays a bool, anything else as it is (refused)


@pytest.mark.parametrize("position", [0, 4])
async def test_a_token_id_that_lies_about_its_range_is_refused_and_fails_no_neighbour(tiny_models, hf_greedy,
                                                                                        position) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 24)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        neighbour = asyncio.create_task(engine.generate(GOOD, greedy))
        await asyncio.sleep(0.05)  # the neighbour is decoding when the lie arrives
        hostile = list(GOOD)
        hostile[position] = Posing(10**6, 5)
        for call in (lambda: engine.generate(hostile, SamplingParams(max_tokens=3)),
                     lambda: engine.stream(hostile, SamplingParams(max_tokens=3)).__anext__()):
            with pytest.raises(InvalidParameterError) as refused:
                await call()
            assert refused.value.parameter == "prompt" and refused.value.value == 10**6
        assert (await neighbour).token_ids == expected
        assert engine.step_stats().failed_steps == 0
    assert engine.kv_stats().used_blocks == 0


AGREEABLE_PARAMS = {  # each a value outside its field's range, in a type whose comparisons say it is inside
    "n": Posing(10_000, 2),
    "max_tokens": Posing(-5, 8),
    "min_tokens": Posing(10**9, 1),
    "seed": Posing(-1, 1),
    "top_k": Posing(-7, 2),
    "logprobs": Posing(10**6, 2),
    "temperature": PosingFloat(-1.0, 0.5),
    "top_p": PosingFloat(5.0, 0.5),
    "min_p": PosingFloat(-3.0, 0.5),
    "presence_penalty": PosingFloat(1e30, 0.5),
    "repetition_penalty": PosingFloat(0.0, 1.0),
    "stop_token_ids": [Posing(-3, 3)],
}


@pytest.mark.parametrize("field", AGREEABLE_PARAMS)
def test_sampling_params_check_the_number_a_value_holds(field) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        SamplingParams(**{field: AGREEABLE_PARAMS[field]})
    assert refused.value.parameter == field


def test_sampling_params_keep_plain_numbers() -> None:
    params = SamplingParams(max_tokens=Posing(7, 7), temperature=PosingFloat(0.5, 0.5), n=Posing(2, 2),
                            seed=Posing(3, 3), stop_token_ids=[Posing(4, 4)])
    assert (params.max_tokens, params.temperature, params.n, params.seed, params.stop_token_ids) == (7, 0.5, 2, 3, [4])
    assert [type(v) for v in (params.max_tokens, params.temperature, params.n, params.seed,
                              *params.stop_token_ids)] == [int, float, int, int, int]
    assert type(plain_params(params).max_tokens) is int


async def test_ten_thousand_samples_behind_a_posing_n_are_refused_at_the_call(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 16)
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        neighbour = asyncio.create_task(engine.generate(GOOD, SamplingParams(max_tokens=16, ignore_eos=True)))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidParameterError) as refused:
            await engine.generate(GOOD, SamplingParams(max_tokens=3, temperature=1.0, n=Posing(10_000, 2)))
        assert refused.value.parameter == "n"
        assert (await neighbour).token_ids == expected
    assert engine.kv_stats().used_blocks == 0


class EngineSideHash(str):
    """A str whose ``__hash__`` works on the caller's thread and raises on any other (the engine thread)."""

    caller = threading.get_ident()

    def __hash__(self) -> int:
        if threading.get_ident() != self.caller:
            raise RuntimeError("hashed off the caller's thread")
        return str.__hash__(self)

    __eq__ = str.__eq__


@pytest.mark.parametrize("argument", ["request_id", "cache_salt"])
async def test_a_str_subclass_whose_hash_raises_on_the_engine_thread_harms_nobody(tiny_models, hf_greedy,
                                                                                  argument) -> None:
    """Before: the id's ``__hash__`` raised in the engine thread's step loop (EngineDeadError for every caller,
    and the engine dead); the salt's in the scheduler's admission, failing the neighbours' step."""
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 24)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    EngineSideHash.caller = threading.get_ident()
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        neighbour = asyncio.create_task(engine.generate(GOOD, greedy))
        await asyncio.sleep(0.05)
        value = EngineSideHash("hostile")
        own = await engine.generate(GOOD, greedy, **{argument: value})  # type: ignore[arg-type]
        assert own.token_ids == expected and type(own.request_id) is str
        assert (await neighbour).token_ids == expected
        engine.abort(EngineSideHash("hostile"))  # a finished id: nothing to abort, and nothing raised
        assert (await engine.generate(GOOD, greedy)).token_ids == expected
        assert engine.step_stats().failed_steps == 0
    assert engine.kv_stats().used_blocks == 0


def test_a_priority_that_poses_as_in_range_is_refused() -> None:
    from asyncinfer.prompts import MAX_PRIORITY, check_request_args

    with pytest.raises(InvalidParameterError) as refused:
        check_request_args(None, Posing(10**40, 0), None)
    assert refused.value.parameter == "priority"
    _, priority, salt = check_request_args(None, Posing(MAX_PRIORITY, 0), EngineSideHash("s"))
    assert (type(priority), priority, type(salt), salt) == (int, MAX_PRIORITY, str, "s")


class Undecided(FIFOScheduler):
    """FIFO whose ``has_unfinished_requests`` raises once ``broken`` (each time it is asked)."""

    broken = False

    def has_unfinished_requests(self) -> bool:
        if Undecided.broken:
            raise ValueError("this plugin cannot tell")
        return super().has_unfinished_requests()


async def test_a_plugin_whose_has_unfinished_requests_raises_is_logged_and_survived(tiny_models, hf_greedy,
                                                                                     caplog) -> None:
    """The engine thread asks each core whether it has work between steps; a plugin whose answer raised ended the
    step loop (every caller's request an EngineDeadError, the engine dead). Now it is logged once and answered
    from the requests the scheduler holds."""
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 8)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    Undecided.broken = False
    engine = AsyncEngine.from_pretrained(path, **BASE, scheduler=Undecided)
    Undecided.broken = True  # from now on (warm-up, at load, asks it too: a fault there refuses the load)
    async with engine:
        for _ in range(2):
            outs = await asyncio.wait_for(asyncio.gather(*[engine.generate(GOOD, greedy) for _ in range(3)]), 60)
            assert [o.token_ids for o in outs] == [expected] * 3
        assert engine.state.value == "running" and engine.step_stats().failed_steps == 0
    assert engine.kv_stats().used_blocks == 0
    Undecided.broken = False
    faults = [r for r in caplog.records if "has_unfinished_requests" in r.getMessage()]
    assert len(faults) == 1 and "this plugin cannot tell" in faults[0].getMessage()


def test_a_gguf_tensor_with_a_dimension_past_int64_is_refused_at_parse(tmp_path) -> None:
    """A tensor of dims (2**64 - 1, 0, ...) holds no bytes, so it passed the check that its bytes lie in the file,
    and was accepted into the index; reading it was a TypeError from torch (a size it cannot hold), not a
    ModelLoadError. The reader now refuses a dimension past ggml's int64 sizes when it parses the header."""
    import gguf
    import numpy as np

    from asyncinfer import ModelLoadError
    from asyncinfer.models.gguf_file import GGUFFile

    path = tmp_path / "dims.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("f32", np.zeros((0, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFFile(path).tensors[0].shape == (0, 4)
    data = bytearray(path.read_bytes())
    at = data.index(b"f32") + 3 + 4  # the name, then n_dims (u32): the first dimension (u64)
    assert int.from_bytes(data[at:at + 8], "little") == 4
    data[at:at + 8] = (2**64 - 1).to_bytes(8, "little")
    (tmp_path / "huge.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="'f32' has a dimension of 18446744073709551615"):
        GGUFFile(tmp_path / "huge.gguf")


class Uncounted(FIFOScheduler):
    """FIFO whose ``num_running`` and ``num_waiting`` raise once ``broken``; ``stalling`` schedules nothing."""

    broken = False
    stalling = False

    @property
    def num_running(self) -> int:
        if Uncounted.broken:
            raise ValueError("this plugin cannot count")
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        if Uncounted.broken:
            raise ValueError("this plugin cannot count")
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        if Uncounted.stalling:
            return SchedulerOutput()  # an empty plan: nothing scheduled, ever
        return super().schedule()


async def test_a_plugin_whose_counts_raise_fails_no_scrape_and_no_stall_check(tiny_models, hf_greedy, caplog) -> None:
    """``num_running``/``num_waiting`` of a plugin are read by ``engine.metrics`` (every ``/metrics`` scrape) and by
    the stall check's message on the engine thread: a plugin whose counts raised failed every scrape, and, once
    its requests stalled, ended the engine thread (EngineDeadError for everyone) instead of failing the stalled
    requests with RequestStalledError. The counts now come from the scheduler's queues when the plugin's raise."""
    from prometheus_client import generate_latest

    from asyncinfer.errors import RequestStalledError

    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 8)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    Uncounted.broken = Uncounted.stalling = False
    engine = AsyncEngine.from_pretrained(path, **BASE, scheduler=Uncounted, stall_timeout=0.5)
    Uncounted.broken = True
    try:
        async with engine:
            assert (await engine.generate(GOOD, greedy)).token_ids == expected
            assert b"asyncinfer_" in generate_latest(engine.metrics.registry)  # the scrape is whole
            Uncounted.stalling = True
            with pytest.raises(RequestStalledError, match="with 0 running and 1 waiting"):
                await asyncio.wait_for(engine.generate(GOOD, greedy), 60)
            Uncounted.stalling = False
            assert (await engine.generate(GOOD, greedy)).token_ids == expected
            assert engine.state.value == "running"
    finally:
        Uncounted.broken = Uncounted.stalling = False
    faults = [r for r in caplog.records if "num_running or num_waiting" in r.getMessage()]
    assert len(faults) == 1 and "this plugin cannot count" in faults[0].getMessage()
