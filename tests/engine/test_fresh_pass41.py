"""A ``str`` subclass wrote lines of its own into the ``asyncinfer.models`` log (pass41).

``plain.logged`` shows a caller's text in a log line quoted and escaped when it holds a line break, but it read the
text through the text's own methods: a subclass answering ``isprintable()`` with True and ``in`` with False came back
as itself, and ``%s`` wrote whatever its ``__str__`` returned, line breaks included (a model name given to
``swap_model`` whose load failed). ``swap_model``'s ``mode`` was not read as the text it holds at all: a subclass
whose ``==`` answers True passed the check, ran as whichever mode the swap compared it with first, and was written
into the line as its ``__str__`` chose. Both are now read as the built-in ``str`` they hold
(:func:`asyncinfer.plain.plain_value`), as every other caller's value is.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from asyncinfer import AsyncEngine, EngineOverloadedError, SamplingParams, SwapError
from asyncinfer.plain import logged
from tests.helpers import ENGINE_BASE, fill_stop_turns, long_stops, slow_stop_turns_engine

FORGED = "x\nasyncinfer.models model removed model=chat abort=True"


class Posing(str):
    """A text that says it is printable, holds no space, equals anything and shows itself as another line."""

    def isprintable(self) -> bool:
        return True

    def __contains__(self, item: object) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return FORGED

    def __format__(self, spec: str) -> str:
        return FORGED


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "asyncinfer.models"]


def test_logged_reads_a_subclass_as_the_text_it_holds() -> None:
    assert logged(Posing("a\nb")) == "'a\\nb'"
    shown = logged(Posing("chat"))
    assert type(shown) is str and shown == "chat" and f"{shown}" == "chat"


async def test_a_posing_mode_or_name_writes_no_line_of_its_own(tiny_models, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="asyncinfer.models")
    llama = tiny_models["llama"][0]
    engine = AsyncEngine.from_pretrained(llama, name="chat", **ENGINE_BASE)
    async with engine:
        await engine.swap_model(llama, name="chat", mode=Posing("overlap"))
        with pytest.raises(SwapError):
            await engine.swap_model(tmp_path / "missing", name=Posing("chat"))
        with pytest.raises(ValueError):  # the text it holds is no mode
            await engine.swap_model(llama, name="chat", mode=Posing("sideways"))
    swapped, failed = _lines(caplog)
    assert swapped.startswith("model swapped model=chat version=1 mode=overlap source=")
    assert failed.startswith("model swap failed model=chat mode=overlap source=")
    assert all("\n" not in line and "abort=True" not in line for line in (swapped, failed))


async def test_streams_read_after_their_call_wait_their_turns_within_the_limit(tiny_models, monkeypatch) -> None:
    """A stream is checked at its call but sends its request (and waits its turn) when first read: streams made
    together, each passing the check while none was counted, then read together, all waited their turns counted
    in flight, past ``max_num_seqs + max_waiting_requests`` (each past the limit refused only after its wait).
    A stream past the limit at its first read is refused then, at once."""
    engine = slow_stop_turns_engine(tiny_models["llama"][0], monkeypatch)  # 4 places; a long list every 4 s
    async with engine:
        await fill_stop_turns(engine, long_stops)
        streams = [engine.stream([5, 6, 7], SamplingParams(max_tokens=1, stop=long_stops(2 + i))) for i in range(6)]

        async def first(stream) -> object:
            return await anext(stream)

        reads = [asyncio.ensure_future(first(s)) for s in streams]
        await asyncio.sleep(0.3)
        refused = [r for r in reads if r.done() and isinstance(r.exception(), EngineOverloadedError)]
        assert len(refused) == 2 and not any(r.done() for r in reads if r not in refused)
        for r in reads:
            r.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        for s in streams:
            await s.aclose()
        engine.check_admission(4)  # nothing is counted any more
