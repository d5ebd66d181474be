"""benchmarks/soak.py loads its model off the event loop (stranger28).

``python benchmarks/soak.py`` loaded with ``AsyncEngine.from_pretrained`` inside its coroutine, so the engine's own
warning, "a model is loading on the event loop's thread ... use 'await AsyncEngine.load(...)'", was the first line a
user running the documented soak saw, about the project's code rather than theirs.
"""

from __future__ import annotations

import logging

from tests.helpers import REPO_ROOT, load_script


async def test_the_soak_loads_without_the_on_the_loop_warning(tiny_models, monkeypatch, caplog) -> None:
    soak = load_script(monkeypatch, REPO_ROOT / "benchmarks" / "soak.py", "stranger28_soak").soak
    with caplog.at_level(logging.WARNING, logger="asyncinfer"):
        result = await soak(tiny_models["llama"][0], requests=40, concurrency=4, warmup=8, rss_budget_mib=128.0)
    assert result["ok"], result["checks"]
    assert "loading on the event loop's thread" not in caplog.text
