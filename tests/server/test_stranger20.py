"""An operator's first day (stranger20): what the deployment tools say against a running server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    done, result = slow_clients(keyed.url, tmp_path, "--connections", "4", "--mode", "body")
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
