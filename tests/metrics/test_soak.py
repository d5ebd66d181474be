"""The soak benchmark, short: after 300 mixed requests (cancels, aborts, prefix hits, n=2, a swap)
the engine holds no block and no request, and every request ended exactly once in its metrics."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("asyncinfer_soak_benchmark", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.soak


async def test_a_short_soak_returns_to_its_baseline(tiny_models) -> None:
    soak = load_soak()
    result = await soak(tiny_models["llama"][0], requests=300, concurrency=8, warmup=40, rss_budget_mib=128.0)
    assert result["ok"], (result["checks"], result["rss_growth_mib"], result["baseline"], result["after"])
    assert result["kinds"]["cancelled"] > 10 and result["kinds"]["aborted"] > 10 and result["kinds"]["swaps"] == 1
    after = result["after"]["by_reason"]
    assert after["abort"] > 20 and after["error"] == 0
