"""docs/monitoring/alerts_test.yml fires every alert of alerts.yml (stranger20): the queue alert's description
read "0.03333333333333333 more waiting requests per second", and four alerts had no test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "docs" / "monitoring"


def test_every_alert_has_a_case_that_fires_it() -> None:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    tests = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())
    fired = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert len(alerts) == 9  # AsyncInferModelNotServing the ninth (stranger83)
    assert fired == alerts, sorted(alerts - fired)


def test_the_queue_alert_says_its_rate_in_two_decimals() -> None:
    """promtool test rules runs the cases (tests/metrics/test_monitoring_files.py runs the same where promtool is);
    here the description as promtool renders it for the synthetic queue growing by 2 a minute."""
    tests = (MONITORING / "alerts_test.yml").read_text()
    assert 'description: "0.03 more waiting requests per second over 10 minutes' in tests
    assert '{{ $value | printf \\"%.2f\\" }} more waiting requests per second' in (MONITORING / "alerts.yml").read_text()
    promtool = shutil.which("promtool")
    if promtool is not None:  # the CI image and this project's machine have it (Debian's prometheus package)
        done = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], capture_output=True, text=True,
                              timeout=60, cwd=MONITORING, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
