"""Model changes write log lines (``asyncinfer.models``): one INFO line for each swap, add and remove that took
effect, one WARNING for a swap or add whose model failed to load; a name with a line break stays on one line."""

from __future__ import annotations

import logging

import pytest

from asyncinfer import AsyncEngine, ModelLoadError, SwapError
from tests.helpers import ENGINE_BASE


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "asyncinfer.models"]


async def test_swap_add_and_remove_each_log_a_line(tiny_models, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="asyncinfer.models")
    llama, qwen = tiny_models["llama"][0], tiny_models["qwen2"][0]
    engine = AsyncEngine.from_pretrained(llama, name="chat", **ENGINE_BASE)
    async with engine:
        swapped = await engine.swap_model(qwen, name="chat")
        added = await engine.add_model("two\nlines", llama, **ENGINE_BASE)
        await engine.remove_model("two\nlines")
        with pytest.raises(SwapError):
            await engine.swap_model(tmp_path / "missing", name="chat")
        with pytest.raises(ModelLoadError):
            await engine.add_model("other", tmp_path / "missing", **ENGINE_BASE)
    lines = _lines(caplog)
    assert [level for level, _ in lines] == [logging.INFO] * 3 + [logging.WARNING] * 2
    swap, add, remove, swap_failed, add_failed = (text for _, text in lines)
    assert swap.startswith(f"model swapped model=chat version={swapped.version_id} mode=overlap source=")
    assert "took_s=" in swap
    assert add.startswith(f"model added model='two\\nlines' kind=generate version={added.version_id} source=")
    assert remove == "model removed model='two\\nlines' abort=False"
    assert swap_failed.startswith("model swap failed model=chat mode=overlap source=")
    assert "error=SwapError" in swap_failed
    assert add_failed.startswith("model add failed model=other source=") and "error=ModelLoadError" in add_failed
    assert all("\n" not in text for _, text in lines)


async def test_a_refused_change_logs_nothing(tiny_models, caplog):
    """A call refused before anything was read (a bad argument) is the caller's error, raised to it: no line."""
    caplog.set_level(logging.INFO, logger="asyncinfer.models")
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        with pytest.raises(ValueError):
            await engine.swap_model(mode="sideways")
        with pytest.raises(ValueError):
            await engine.remove_model("nobody")
    assert _lines(caplog) == []
