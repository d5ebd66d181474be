"""A request's stop automaton is built when it is bound (on the loop for a short list, in a worker thread for a long
one), never on the engine thread, where a list at the limits (1024 strings, 16,384 characters: ~10 ms to build) took
as long as a decode step of every request there, for each such request of a flood (pass37). Its samples share it."""

from __future__ import annotations

import threading

import pytest

import asyncinfer.detokenizer
from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.intake import STOPS_ON_LOOP_CHARS
from tests.helpers import ENGINE_BASE


class CharTokenizer:
    """Each token id decodes to a character of its own (the tiny model has no tokenizer)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


@pytest.fixture
def builds(monkeypatch) -> list[tuple[str, int]]:
    """Each StopMatcher built: the thread that built it and how many characters its strings hold."""
    seen: list[tuple[str, int]] = []
    real = asyncinfer.detokenizer.StopMatcher.__init__

    def init(self, strings):
        seen.append((threading.current_thread().name, sum(map(len, strings))))
        real(self, strings)

    monkeypatch.setattr(asyncinfer.detokenizer.StopMatcher, "__init__", init)
    return seen


async def test_no_stop_automaton_is_built_on_the_engine_thread(tiny_models, builds) -> None:
    short = ["zz"]
    long = [f"{i:04d}qqqqqqqqqqqq" for i in range(1024)]  # 16,384 characters, each string a candidate
    assert sum(map(len, long)) > STOPS_ON_LOOP_CHARS >= sum(map(len, short))
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    engine.core.tokenizer = CharTokenizer()
    async with engine:
        loop_thread = threading.current_thread().name
        plain = await engine.generate([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
        first = plain.outputs[0].text[0]
        for stop in (short, long):
            out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=6, stop=stop, n=3, temperature=1.0,
                                                                  seed=1, ignore_eos=True))
            assert [len(o.token_ids) for o in out.outputs] == [6, 6, 6]
        stopped = await engine.generate([5, 6, 7], SamplingParams(max_tokens=6, stop=[first] + long[1:]))
        assert (stopped.outputs[0].text, stopped.outputs[0].finish_reason) == ("", "stop")  # the automaton works
    assert [chars for _, chars in builds[-4:]] == [0, 2, 16384, 1 + 16384 - 16]  # one a request, its samples sharing it
    assert builds[-3][0] == loop_thread
    assert builds[-2][0] not in (loop_thread, "asyncinfer-core") and builds[-1][0] == builds[-2][0]
    assert all(name != "asyncinfer-core" for name, chars in builds if chars), builds
