"""An operator's first day (stranger20): what the deployment tools say against a running server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from asyncinfer.server import ModelSpec, ServerSettings, create_app

from .conftest import TINY_OPTIONS, LiveServer

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1.0  # the header and body deadlines of these servers
KEY = "sk-slow"


def slow_clients(url: str, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "slow.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "slow_clients.py"), "--url", url,
                           "--interval", "0.1", "--give-up", str(LIMIT + 8), "--json", str(out), *args],
                          capture_output=True, text=True, timeout=120, check=False)
    return done, json.loads(out.read_text()) if out.exists() else {}


@pytest.fixture(scope="module")
def keyed(tiny_models):
    settings = ServerSettings(api_keys=(KEY,), header_timeout=LIMIT, body_timeout=LIMIT, max_connections=16)
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings),
                    settings) as live:
        yield live


def test_slow_bodies_with_the_servers_key_reach_the_body_deadline(keyed, tmp_path) -> None:
    """On a server with API keys, --mode body with --api-key measures the body deadline (408s), not the 401."""
    done, result = slow_clients(keyed.url, tmp_path, "--connections", "10", "--mode", "body", "--api-key", KEY)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert (result["closed"], result["statuses"], result["ordinary_request_status"]) == (10, {"408": 10}, 200)
    assert result["closed_after_s"]["min"] >= LIMIT * 0.9


def test_slow_bodies_without_a_key_are_refused_401_and_the_docstring_says_to_give_one(keyed, tmp_path) -> None:
    _, result = slow_clients(keyed.url, tmp_path, "--connections", "4", "--mode", "body")
    assert result["statuses"] == {"401": 4}
    assert "--api-key" in (ROOT / "benchmarks" / "slow_clients.py").read_text().split('"""')[1]


def test_an_ordinary_request_over_the_connection_cap_is_reported_as_its_503(keyed, tmp_path) -> None:
    """More slow connections than --max-connections leave the ordinary request a 503: said so, not 'no answer'."""
    done, result = slow_clients(keyed.url, tmp_path, "--connections", "20", "--api-key", KEY)
    assert done.returncode == 1
    assert result["ordinary_request_s"] is None and result["ordinary_request_status"] == 503
    assert ("an ordinary request meanwhile: answered 503 (the connection cap: --connections over the server's"
            " --max-connections)") in done.stdout


def test_an_api_key_with_spaces_around_it_is_refused_by_its_flag(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "slow_clients.py"), "--api-key", " sk-x"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--api-key must be a non-empty key of printable characters without spaces around it" in done.stderr


def metric_lines(live: LiveServer, metrics_key: str) -> dict[str, float]:
    text = httpx.get(live.url + "/metrics", headers={"authorization": f"Bearer {metrics_key}"}).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("asyncinfer_http_responses_total{", "asyncinfer_rejected_requests_total{"))}


def test_refusals_before_the_engine_are_counted_by_status_as_the_monitoring_readme_says(tiny_models) -> None:
    """docs/monitoring/README.md: a tenant's 429, a key's 401 and a body's 413 are in asyncinfer_http_responses_total
    (by status) and not in asyncinfer_rejected_requests_total; the dashboard charts them."""
    settings = ServerSettings(api_keys=(KEY,), metrics_keys=("ops",), max_requests_per_tenant=1, max_body_bytes=4096)
    with LiveServer(create_app(ModelSpec(str(tiny_models["qwen2"][0]), "ids", TINY_OPTIONS), settings),
                    settings) as live:
        auth = {"authorization": f"Bearer {KEY}"}
        body = {"model": "ids", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=live.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body, headers=auth) as held:
                assert held.status_code == 200
                refused = http.post("/v1/completions", json={**body, "stream": False}, headers=auth)
                assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_requests_exceeded"
                held.read()
            assert http.post("/v1/completions", json=body, headers={"authorization": "Bearer nope"}).status_code == 401
            big = http.post("/v1/completions", content=b"x" * 8192, headers={**auth, "content-type": "application/json"})
            assert big.status_code == 413
        lines = metric_lines(live, "ops")
    assert lines['asyncinfer_http_responses_total{route="/v1/completions",status="429"}'] == 1.0
    assert lines['asyncinfer_http_responses_total{route="/v1/completions",status="401"}'] == 1.0
    assert lines['asyncinfer_http_responses_total{route="/v1/completions",status="413"}'] == 1.0
    assert lines['asyncinfer_rejected_requests_total{model="ids",reason="invalid"}'] == 0.0
    assert lines['asyncinfer_rejected_requests_total{model="ids",reason="overloaded"}'] == 0.0
    readme = (ROOT / "docs" / "monitoring" / "README.md").read_text()
    assert "| `asyncinfer_http_responses_total` | counter | route, status |" in readme
    dashboard = json.loads((ROOT / "docs" / "monitoring" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert ('sum by (route, status) (rate(asyncinfer_http_responses_total{status=~"401|429|503"}[$__rate_interval]))'
            in exprs)
