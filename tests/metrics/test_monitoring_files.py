"""docs/monitoring: the alert rules pass promtool, and every metric the dashboard and the rules
query is one a running engine exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.metrics.exposition import exposition, metric_names
from asyncinfer.server.metrics import exposition as server_exposition
from asyncinfer.server.metrics import metrics_registry

MONITORING = Path(__file__).resolve().parents[2] / "docs" / "monitoring"
METRIC = re.compile(r"\b((?:asyncinfer|process)_[a-z0-9_]+)\b")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing in CI: .ci/run installs Debian's prometheus package")
        pytest.skip("promtool is not installed (apt-get install prometheus); CI installs it")
    return found


def test_alert_rules_pass_promtool() -> None:
    result = subprocess.run([promtool(), "check", "rules", str(MONITORING / "alerts.yml")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alerts_fire_on_synthetic_series() -> None:
    """alerts_test.yml: every alert fires when it should (tests/metrics/test_stranger20.py checks that each has a case)."""
    result = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], capture_output=True, text=True,
                            timeout=60, cwd=MONITORING, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_lists_every_metric() -> None:
    readme = (MONITORING / "README.md").read_text()
    for name in metric_names():
        assert f"`{name}" in readme, name


def expressions() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    exprs += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    return exprs


def base_name(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


async def test_every_queried_metric_is_exported(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], kv_cache_memory=4 * 1024 * 1024,
                                         max_model_len=256, dtype="float32", device="cpu", memory_bandwidth=1e10)
    async with engine:
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        exported = {f.name for f in text_string_to_metric_families(exposition(engine).decode())}
    # the HTTP layer's own family, which asyncinfer serve's /metrics adds to the engine's
    exported |= {f.name for f in text_string_to_metric_families(
        server_exposition(metrics_registry(lambda: engine, Counter())).decode())}
    queried = {base_name(m) for expr in expressions() for m in METRIC.findall(expr)}
    assert len(queried) >= 25
    assert queried <= exported, sorted(queried - exported)
