"""A swap whose caller is cancelled (``asyncio.wait_for(engine.swap_model(...), t)``, a task cancelled) is counted
and written as what happened (stranger62): it counted in no outcome of ``asyncinfer_swaps_total`` and wrote no line
on ``asyncinfer.models``, so an operator counting swaps saw nothing. Now: ``cancelled`` with an INFO line where the
old version serves on, ``ok`` with the ``model swapped`` line where the new one serves (a drain runs to its end)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from asyncinfer import AsyncEngine, loading
from tests.helpers import ENGINE_BASE, greedy, random_prompts

PROMPT = random_prompts(1, seed=62)[0]


@pytest.fixture
def slow_warm_up(monkeypatch):
    """``arm()``: from then on every load's warm-up waits until the event it returns is set (at most 30 s)."""
    real = loading.warm_up

    def arm() -> threading.Event:
        release = threading.Event()

        def warm_up(core, stall_timeout=None) -> None:
            release.wait(30)
            real(core, stall_timeout)

        monkeypatch.setattr(loading, "warm_up", warm_up)
        return release

    return arm


def swaps(engine: AsyncEngine) -> dict[str, int]:
    return dict(engine.metrics.snapshot().models["default"].swaps)


async def tokens(engine: AsyncEngine) -> list[int]:
    return (await engine.generate(PROMPT, greedy(8))).token_ids


async def test_a_swap_cancelled_while_it_waits_its_turn_counts_cancelled(tiny_models, slow_warm_up, caplog) -> None:
    llama, qwen2 = tiny_models["llama"][0], tiny_models["qwen2"][0]
    async with AsyncEngine.from_pretrained(llama, **ENGINE_BASE) as engine:
        before = await tokens(engine)
        release = slow_warm_up()
        first = asyncio.create_task(engine.swap_model(llama))  # holds the swaps' lock in its warm-up
        await asyncio.sleep(0.2)
        with caplog.at_level(logging.INFO, logger="asyncinfer.models"), pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.swap_model(qwen2), 0.2)
        release.set()
        await first
        assert swaps(engine) == {"ok": 1, "refused": 0, "failed": 0, "cancelled": 1}
        assert await tokens(engine) == before  # the cancelled swap's qwen2 never served
    (line,) = [r.getMessage() for r in caplog.records if "cancelled" in r.getMessage()]
    assert line.startswith(f"model swap cancelled model=default mode=overlap source={qwen2} after_s=")


async def test_a_drain_swap_cancelled_midway_runs_to_its_end_and_counts_ok(tiny_models, slow_warm_up, caplog) -> None:
    llama, qwen2 = tiny_models["llama"][0], tiny_models["qwen2"][0]
    async with AsyncEngine.from_pretrained(qwen2, **ENGINE_BASE) as reference:
        expected = await tokens(reference)
    async with AsyncEngine.from_pretrained(llama, **ENGINE_BASE) as engine:
        release = slow_warm_up()
        swap = asyncio.create_task(engine.swap_model(qwen2, mode="drain"))
        await asyncio.sleep(0.3)  # retired the old version, loading the new one
        swap.cancel()
        threading.Timer(0.2, release.set).start()
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="asyncinfer.models"), pytest.raises(asyncio.CancelledError):
            await swap
        assert time.monotonic() - started >= 0.1  # it waited for the swap's end
        assert swaps(engine) == {"ok": 1, "refused": 0, "failed": 0, "cancelled": 0}
        assert await tokens(engine) == expected
    assert any(r.getMessage().startswith("model swapped model=default version=1 mode=drain") for r in caplog.records)


async def test_an_overlap_swap_cancelled_in_its_load_counts_what_serves(tiny_models, slow_warm_up) -> None:
    """The load runs in a worker thread that cannot be stopped: the outcome counted is the one that took effect."""
    llama, qwen2 = tiny_models["llama"][0], tiny_models["qwen2"][0]
    async with AsyncEngine.from_pretrained(qwen2, **ENGINE_BASE) as reference:
        new = await tokens(reference)
    async with AsyncEngine.from_pretrained(llama, **ENGINE_BASE) as engine:
        old = await tokens(engine)
        release = slow_warm_up()
        swap = asyncio.create_task(engine.swap_model(qwen2))
        await asyncio.sleep(0.3)
        swap.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await swap
        counted = swaps(engine)
        serving = await tokens(engine)
    assert serving in (old, new)
    took = serving == new
    assert counted == {"ok": int(took), "refused": 0, "failed": 0, "cancelled": int(not took)}
