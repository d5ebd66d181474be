"""A stranger's first hour (stranger37): what a model swap writes to the log and to ``asyncinfer_swaps_total``.

docs/monitoring/README.md shows a failed swap's WARNING as ``model swap failed model=default ...`` and says the
``asyncinfer.models`` logger writes one "for a swap or add whose model failed to load (the old version serves on)".
A swap naming no model (``engine.swap_model("/models/v3")``, the docs' own call) wrote ``model=<default>``, where the
INFO line of a swap that took effect and ``asyncinfer_swaps_total`` name the generator (``model=default``): a log
search or alert for the model missed exactly the swaps that named none. And ``swap_model`` on a closed engine (a
shutdown racing an admin route's swap) wrote that WARNING, ``... source=None ... error=EngineClosedError``, and
counted the swap ``failed``, as if a model had failed to load: nothing had been read, and ``add_model`` on the same
engine writes no line. Such a swap is now ``refused`` (nothing changed) and writes no line.
"""

from __future__ import annotations

import logging

import pytest

from asyncinfer import AsyncEngine, EngineClosedError, SwapError
from tests.helpers import ENGINE_BASE


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "asyncinfer.models"]


@pytest.mark.parametrize("name", ["default", "chat"])
async def test_a_failed_swap_naming_no_model_logs_the_generator_it_swapped(tiny_models, tmp_path, caplog, name):
    caplog.set_level(logging.INFO, logger="asyncinfer.models")
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], name=name, **ENGINE_BASE)
    async with engine:
        with pytest.raises(SwapError):
            await engine.swap_model(tmp_path / "v3")
        swaps = engine.metrics.snapshot().models[name].swaps
    [(level, line)] = _lines(caplog)
    assert level == logging.WARNING
    assert line.startswith(f"model swap failed model={name} mode=overlap source="), line  # was model=<default>
    assert "error=SwapError" in line
    assert swaps == {"ok": 0, "refused": 0, "failed": 1, "cancelled": 0}


async def test_a_swap_on_a_closed_engine_is_refused_without_a_warning(tiny_models, caplog):
    caplog.set_level(logging.INFO, logger="asyncinfer.models")
    path = tiny_models["llama"][0]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        pass
    with pytest.raises(EngineClosedError):
        await engine.add_model("other", path, **ENGINE_BASE)
    for mode in ("overlap", "drain"):
        with pytest.raises(EngineClosedError):
            await engine.swap_model(path, mode=mode)
    assert _lines(caplog) == []  # was: WARNING model swap failed ... error=EngineClosedError, like no add_model
    assert engine.metrics.snapshot().models["default"].swaps == {"ok": 0, "refused": 2, "failed": 0, "cancelled": 0}


# docs/memory.md: plan_memory plans "before loading anything". For a sentence encoder that did not fit it said "the
# embedding model does not fit beside the loaded models" (nothing was loaded), with no word of what to lower; and
# add_model's refusal ended "Lower max_batch_size / max_seq_len.", where all-MiniLM-L6-v2's largest batch under the
# defaults is 8 texts of 256 tokens, bounded by max_batch_tokens (2048 slots), so max_batch_size=9 (from 32) was
# refused again with the same numbers. The refusal now names the limits that make its largest batch.
async def test_an_embedding_model_that_does_not_fit_names_what_to_lower(tiny_models, minilm_dir):
    from asyncinfer import ConfigurationError

    plan = AsyncEngine.plan_memory(minilm_dir)
    texts, tokens = plan.largest_batch
    assert texts < plan.max_batch_size == 32 and tokens == plan.max_seq_len  # max_batch_tokens bounds the batch
    short = plan.total_bytes - 1
    with pytest.raises(ConfigurationError) as alone:
        AsyncEngine.plan_memory(minilm_dir, available_bytes=short)
    assert "beside the loaded models" not in str(alone.value)  # nothing is loaded before a plan
    assert str(alone.value).startswith("the embedding model does not fit: ")
    assert str(alone.value).endswith("; lower max_batch_tokens / max_seq_len.")
    AsyncEngine.plan_memory(minilm_dir, available_bytes=short, max_batch_tokens=1024)  # what it names fits
    with pytest.raises(ConfigurationError, match=r"its weights alone need [0-9.]+ MiB"):
        AsyncEngine.plan_memory(minilm_dir, available_bytes=plan.weight_bytes)
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        with pytest.raises(ConfigurationError) as beside:
            await engine.add_model("emb", minilm_dir, available_bytes=short, max_batch_size=texts + 1)
        assert str(beside.value).startswith("the embedding model does not fit beside the loaded models: ")
        assert "max_batch_size" not in str(beside.value)  # was: "Lower max_batch_size / max_seq_len."
        await engine.add_model("emb", minilm_dir, available_bytes=short, max_batch_tokens=1024)
